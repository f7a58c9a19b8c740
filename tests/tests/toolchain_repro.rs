//! Reproducibility: the same target built from two copies of the source tree at different absolute
//! paths (each with its own empty cache, so both really compile) gives byte-identical blobs, identical
//! closure hashes and identical attestation subjects; no absolute path leaks into the attestation.

mod toolchain_support;

use std::path::Path;

use toolchain_support::*;

fn build(
    tree: &Path,
) -> (
    std::collections::BTreeMap<String, Vec<u8>>,
    serde_json::Value,
    String,
) {
    copy_sources(tree);
    let out = tree.join("out");
    let cache = tree.join("cache");
    let args = [
        "build-target",
        "--hw",
        "h200",
        "--model",
        "smollm2-135m",
        "--quant",
        "q4_1",
        "--kernels-only",
        "--repo",
        tree.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ];
    let o = run_xtask(&args);
    assert!(o.status.success(), "build-target failed");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(err.contains("0 cached"), "expected a cold build: {err}");
    let mut blobs = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(out.join("kernels")).unwrap() {
        let e = e.unwrap();
        blobs.insert(
            e.file_name().to_string_lossy().into_owned(),
            std::fs::read(e.path()).unwrap(),
        );
    }
    let text = std::fs::read_to_string(out.join("attestation.json")).unwrap();
    (blobs, serde_json::from_str(&text).unwrap(), text)
}

#[test]
fn two_clones_at_different_paths_build_identical_kernels() {
    if !toolchain_present("reproducibility test") {
        return;
    }
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let b_deep = b.path().join("a/much/longer/path/to/another clone");
    let (blobs_a, att_a, text_a) = build(a.path());
    let (blobs_b, att_b, text_b) = build(&b_deep);
    let id = metrale_core::target::TargetId::new("h200", "smollm2-135m", "q4_1");
    let spec = metrale_core::target::TargetSpec::load(&repo().join("targets"), &id).unwrap();
    assert_eq!(
        blobs_a.len(),
        2 * spec.kernels.len(),
        "every kernel of the target x (cubin, ptx)"
    );
    assert_eq!(
        blobs_a.keys().collect::<Vec<_>>(),
        blobs_b.keys().collect::<Vec<_>>(),
        "the clones built different blob sets"
    );
    let differing: Vec<&String> = blobs_a
        .iter()
        .filter(|(k, v)| blobs_b.get(*k) != Some(v))
        .map(|(k, _)| k)
        .collect();
    assert!(
        differing.is_empty(),
        "blobs differ between clones: {differing:?}"
    );
    let closures = |att: &serde_json::Value| -> Vec<(String, String)> {
        att["predicate"]["buildDefinition"]["internalParameters"]["kernels"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v["closure_hash"].as_str().unwrap().to_string()))
            .collect()
    };
    assert_eq!(closures(&att_a), closures(&att_b));
    assert_eq!(att_a["subject"], att_b["subject"]);
    assert_eq!(text_a, text_b, "the kernel statements differ");
    for (text, tree) in [(&text_a, a.path()), (&text_b, b_deep.as_path())] {
        assert!(
            !text.contains(tree.to_str().unwrap()),
            "the attestation names the source tree's path"
        );
        assert!(
            !text.contains("/.toolchain"),
            "the attestation names the toolchain's path"
        );
        assert!(!text.contains("-lineinfo"));
    }
}
