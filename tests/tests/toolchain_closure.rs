//! Closure hashes and the content-addressed cache, on fixture templates (not the real kernels): a
//! second build compiles nothing; a one-byte change in one header recompiles exactly the kernels whose
//! closure holds it and changes exactly their hashes. Also: every CUDA target's real kernels compile.

mod toolchain_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use metrale_codegen::{build_kernels, BuildRequest, BuiltKernel};
use metrale_core::target::{list_targets, BackendKind, TargetId, TargetSpec};
use toolchain_support::*;

fn fixture(dir: &Path) -> TargetSpec {
    write_fixture_kernels(dir);
    let real = TargetSpec::load(
        &repo().join("targets"),
        &TargetId::new("h200", "smollm2-135m", "q4_1"),
    )
    .unwrap();
    let mut table: toml::Table = real.model_toml.parse().unwrap();
    table.insert(
        "kernels".into(),
        toml::Value::Array(
            TEMPLATES
                .iter()
                .map(|(n, _)| toml::Value::String(n.to_string()))
                .collect(),
        ),
    );
    TargetSpec::from_toml(
        &real.hardware_toml,
        &toml::to_string(&table).unwrap(),
        &real.id,
    )
    .unwrap()
}

fn build(repo_dir: &Path, spec: &TargetSpec, cache: &Path) -> BTreeMap<String, BuiltKernel> {
    build_jobs(repo_dir, spec, cache, 2)
}

/// [`build`] with `jobs` kernels compiling at once.
fn build_jobs(
    repo_dir: &Path,
    spec: &TargetSpec,
    cache: &Path,
    jobs: usize,
) -> BTreeMap<String, BuiltKernel> {
    let req = BuildRequest {
        repo: repo_dir,
        spec,
        toolchain_dir: metrale_codegen::toolchain::default_dir(&repo()),
        cache_dir: cache,
        jobs,
        force_compile: false,
        nvrtc_worker: xtask(),
    };
    build_kernels(&req, &|_| {})
        .unwrap()
        .into_iter()
        .map(|k| (k.name.clone(), k))
        .collect()
}

fn compiled(b: &BTreeMap<String, BuiltKernel>) -> Vec<&str> {
    b.values()
        .filter(|k| !k.cached)
        .map(|k| k.name.as_str())
        .collect()
}

fn changed(a: &BTreeMap<String, BuiltKernel>, b: &BTreeMap<String, BuiltKernel>) -> Vec<String> {
    a.keys()
        .filter(|k| a[*k].closure_hash != b[*k].closure_hash)
        .cloned()
        .collect()
}

fn flip_one_byte(p: &Path) {
    let mut t = std::fs::read(p).unwrap();
    // change one byte of a numeric literal: the last digit before "f;" becomes another digit
    let j = t.windows(3).position(|w| w == b".0f").expect("a literal");
    t[j + 1] = b'5';
    std::fs::write(p, t).unwrap();
}

#[test]
fn second_build_compiles_nothing_and_one_header_change_recompiles_exactly_its_kernels() {
    if !toolchain_present("closure cache test") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let spec = fixture(dir.path());

    let first = build(dir.path(), &spec, &cache);
    assert_eq!(compiled(&first), vec!["fa", "fb", "fc"]);
    assert_eq!(first["fc"].functions, vec!["fc_one", "fc_two"]);
    assert!(first["fa"].blob("cubin").unwrap().starts_with(b"\x7fELF"));
    let hdr: Vec<&str> = first["fa"]
        .manifest
        .headers
        .iter()
        .map(|h| h.path.as_str())
        .collect();
    assert_eq!(hdr, vec!["kernels/cuda/x.cuh", "kernels/cuda/z.cuh"]);

    let second = build(dir.path(), &spec, &cache);
    assert!(
        compiled(&second).is_empty(),
        "unchanged build compiled {:?}",
        compiled(&second)
    );
    for k in first.keys() {
        assert_eq!(first[k].blobs, second[k].blobs);
    }

    // one byte in x.cuh: only fa holds it
    flip_one_byte(&dir.path().join("kernels/cuda/x.cuh"));
    let third = build(dir.path(), &spec, &cache);
    assert_eq!(compiled(&third), vec!["fa"]);
    assert_eq!(changed(&second, &third), vec!["fa"]);
    assert_eq!(
        first["fa"].manifest.diff(&third["fa"].manifest),
        vec!["kernels/cuda/x.cuh changed".to_string()]
    );

    // one byte in z.cuh: fa (through x.cuh) and fc hold it
    flip_one_byte(&dir.path().join("kernels/cuda/z.cuh"));
    let fourth = build(dir.path(), &spec, &cache);
    assert_eq!(compiled(&fourth), vec!["fa", "fc"]);
    assert_eq!(changed(&third, &fourth), vec!["fa", "fc"]);
    assert_eq!(third["fb"].blobs, fourth["fb"].blobs);

    // and back: the original bytes hit the cache again
    for (n, t) in HEADERS {
        std::fs::write(dir.path().join("kernels/cuda").join(n), t).unwrap();
    }
    let fifth = build(dir.path(), &spec, &cache);
    assert!(compiled(&fifth).is_empty());
    assert!(changed(&first, &fifth).is_empty());

    // a damaged cache entry is never used: fb's cubin is recompiled, and identical to the first one
    let entry = cache.join(&fifth["fb"].closure_hash).join("cubin");
    let mut b = std::fs::read(&entry).unwrap();
    b[100] ^= 0xff;
    std::fs::write(&entry, b).unwrap();
    let sixth = build(dir.path(), &spec, &cache);
    assert_eq!(compiled(&sixth), vec!["fb"]);
    assert_eq!(sixth["fb"].blobs, first["fb"].blobs);
    assert!(compiled(&build(dir.path(), &spec, &cache)).is_empty());
}

#[test]
fn template_errors_name_target_template_and_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let spec = fixture(dir.path());
    std::fs::write(
        dir.path().join("kernels/cuda/fb.cu.hbs"),
        "constexpr int N = {{hw.tensor_cores}};\n",
    )
    .unwrap();
    let e = metrale_codegen::manifest(dir.path(), &spec, "fb")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("h200/smollm2-135m/q4_1")
            && e.contains("kernels/cuda/fb.cu.hbs")
            && e.contains("hw.tensor_cores"),
        "{e}"
    );
    std::fs::write(
        dir.path().join("kernels/cuda/fb.cu.hbs"),
        "#include \"missing.cuh\"\n",
    )
    .unwrap();
    let e = metrale_codegen::manifest(dir.path(), &spec, "fb")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("kernels/cuda/fb.cu.hbs") && e.contains("missing.cuh"),
        "{e}"
    );
}

#[test]
fn compile_errors_show_the_compiler_log_and_kernel() {
    if !toolchain_present("compile error test") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = fixture(dir.path());
    std::fs::write(
        dir.path().join("kernels/cuda/fb.cu.hbs"),
        "extern \"C\" __global__ void fb(float* o) { o[0] = undefined_thing; }\n",
    )
    .unwrap();
    let req = BuildRequest {
        repo: dir.path(),
        spec: &spec,
        toolchain_dir: metrale_codegen::toolchain::default_dir(&repo()),
        cache_dir: &dir.path().join("c"),
        jobs: 1,
        force_compile: false,
        nvrtc_worker: xtask(),
    };
    let e = build_kernels(&req, &|_| {}).unwrap_err().to_string();
    assert!(
        e.contains("kernel `fb`") && e.contains("undefined_thing") && e.contains("sm_90a"),
        "{e}"
    );
}

#[test]
fn every_cuda_target_compiles_its_real_kernels() {
    if !toolchain_present("every CUDA target compiles") {
        return;
    }
    let root = repo().join("targets");
    let cache = target_dir().join("metrale-cache");
    let specs: Vec<TargetSpec> = list_targets(&root)
        .unwrap()
        .iter()
        .map(|id| TargetSpec::load(&root, id).unwrap())
        .filter(|spec| spec.hardware.backend == BackendKind::Cuda)
        .collect();
    assert!(specs.len() >= 16, "only {} CUDA targets", specs.len());
    // The targets compile side by side, each one kernel at a time: a Hopper target's slowest
    // kernel (gemm_hopper, ~20 s of its ~33 s on one core) no longer leaves the other cores idle
    // while its own kernels wait for it, as one target at a time with two jobs did (1.3 cores busy).
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while let Some(spec) = specs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    check_built(spec, &build_jobs(&repo(), spec, &cache, 1));
                }
            });
        }
    });
}

/// Every kernel of `spec` built: a cubin, PTX for the target's PTX arch, entry points.
fn check_built(spec: &TargetSpec, built: &BTreeMap<String, BuiltKernel>) {
    let id = &spec.id;
    assert_eq!(built.len(), spec.kernels.len(), "{id}");
    for k in built.values() {
        assert!(
            k.blob("cubin").is_some_and(|b| b.starts_with(b"\x7fELF")),
            "{id} {}: no cubin",
            k.name
        );
        let ptx = String::from_utf8_lossy(k.blob("ptx").unwrap()).into_owned();
        assert!(
            ptx.contains(&format!(
                ".target {}",
                spec.hardware
                    .ptx_arch
                    .as_deref()
                    .unwrap()
                    .replace("compute_", "sm_")
            )),
            "{id} {}: PTX target",
            k.name
        );
        assert!(!k.functions.is_empty(), "{id} {}", k.name);
    }
}
