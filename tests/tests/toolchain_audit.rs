//! `cargo xtask audit` on one real server binary (built once, reused by every case, since building
//! the binary costs minutes; it embeds the fixture kernels of toolchain_support, so the test does not
//! depend on the state of kernels/cuda): a fresh binary passes (also with --rebuild), a flipped byte inside an
//! embedded blob is caught both by audit and by the runtime's `Registry::verify`, and a changed header
//! in the source tree is reported by name.

mod toolchain_support;

use std::path::Path;

use metrale_attestation::pack::Pack;
use toolchain_support::*;

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The embedded pack of a binary file (the occurrence of the magic that parses).
fn embedded_pack(bin: &[u8]) -> (usize, usize) {
    let mut from = 0;
    while let Some(i) = find(&bin[from..], metrale_attestation::pack::MAGIC) {
        let at = from + i;
        if let Ok(p) = Pack::parse(&bin[at..]) {
            if !p.is_empty() {
                return (at, p.len());
            }
        }
        from = at + 1;
    }
    panic!("no kernel pack in the binary");
}

fn audit(bin: &Path, extra: &[&str]) -> (i32, String) {
    let mut args = vec!["audit", bin.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = run_xtask(&args);
    (
        o.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

#[test]
fn audit_passes_a_fresh_binary_and_catches_tampering_and_source_changes() {
    if !toolchain_present("audit test") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("dist");
    let src = dir.path().join("src");
    fixture_tree(&src);
    let srcs = src.to_str().unwrap();
    let o = run_xtask(&[
        "build-target",
        "--hw",
        "h200",
        "--model",
        "smollm2-135m",
        "--quant",
        "q4_1",
        "--out",
        out.to_str().unwrap(),
        "--repo",
        srcs,
    ]);
    assert!(o.status.success(), "build-target failed");
    let bin = out.join("metrale-server");
    let att: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("attestation.json")).unwrap())
            .unwrap();
    let digest = metrale_attestation::sha256_hex(&std::fs::read(&bin).unwrap());
    let subj = att["subject"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "metrale-server")
        .expect("binary subject");
    assert_eq!(subj["digest"]["sha256"], digest.as_str());

    // 1. a fresh binary passes, also when rebuilt byte for byte
    let (code, text) = audit(&bin, &["--repo", srcs]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("PASS: 3 kernels"), "{text}");
    let (code, text) = audit(&bin, &["--rebuild", "--repo", srcs]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("rebuild byte-identical"), "{text}");

    // the binary's own view of itself
    let o = std::process::Command::new(&bin)
        .arg("--target-info")
        .output()
        .unwrap();
    let info = String::from_utf8_lossy(&o.stdout);
    assert!(
        info.contains("h200/smollm2-135m/q4_1")
            && info.contains("SMs:      132")
            && info.contains("(llama, 576)"),
        "{info}"
    );

    // 2. one flipped byte inside the embedded fa cubin
    let bytes = std::fs::read(&bin).unwrap();
    let cubin = std::fs::read(out.join("kernels/fa.cubin")).unwrap();
    let at = find(&bytes, &cubin).expect("the cubin is embedded verbatim");
    let mut bad = bytes.clone();
    bad[at + cubin.len() / 2] ^= 0x01;
    let bad_bin = dir.path().join("tampered-server");
    std::fs::write(&bad_bin, &bad).unwrap();
    let (code, text) = audit(&bad_bin, &["--repo", srcs]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("MISMATCH fa: blob digest mismatch: kernels/fa.cubin"),
        "{text}"
    );
    assert_eq!(
        text.matches("MISMATCH").count(),
        1,
        "only fa's cubin is bad: {text}"
    );
    // ... and the runtime refuses it before loading
    let (p, len) = embedded_pack(&bad);
    let leaked: &'static [u8] = Box::leak(bad[p..p + len].to_vec().into_boxed_slice());
    let reg = metrale_kernels::Registry::from_pack(leaked);
    match reg.verify() {
        Err(metrale_kernels::KernelsError::DigestMismatch { kernel, blob, .. }) => {
            assert_eq!((kernel.as_str(), blob.as_str()), ("fa", "kernels/fa.cubin"))
        }
        other => panic!("verify of a tampered pack: {other:?}"),
    }
    let (p, len) = embedded_pack(&bytes);
    let good: &'static [u8] = Box::leak(bytes[p..p + len].to_vec().into_boxed_slice());
    let reg = metrale_kernels::Registry::from_pack(good);
    reg.verify().unwrap();
    assert_eq!(reg.kernels.len(), 3);
    let serving = reg.targets_serving("llama", 576);
    assert!(
        serving.contains(&"h200/smollm2-135m/q4_1".to_string())
            && serving.contains(&"cpu/smollm2-135m/bf16".to_string()),
        "{serving:?}"
    );
    assert!(!serving.iter().any(|t| t.contains("llama-3.2-1b")));
    assert_eq!(
        reg.kernel("fc").unwrap().functions,
        vec!["fc_one", "fc_two"]
    );

    // 3. a corrupt pack header
    let mut corrupt = bytes.clone();
    corrupt[p + 20] = 0xff; // entry count
    let corrupt_bin = dir.path().join("corrupt-server");
    std::fs::write(&corrupt_bin, &corrupt).unwrap();
    let (code, text) = audit(&corrupt_bin, &["--repo", srcs]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("corrupt"), "{text}");

    // 4. a changed header in the source tree: every kernel including it is named, with the file
    let tree = dir.path().join("tree");
    fixture_tree(&tree);
    let h = tree.join("kernels/cuda/z.cuh");
    let mut t = std::fs::read_to_string(&h).unwrap();
    t.push_str("\n// one more line\n");
    std::fs::write(&h, t).unwrap();
    let (code, text) = audit(&bin, &["--repo", tree.to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("MISMATCH fa: sources changed: kernels/cuda/z.cuh changed"),
        "{text}"
    );
    assert!(
        text.contains("MISMATCH fc: sources changed: kernels/cuda/z.cuh changed"),
        "{text}"
    );
    assert!(text.contains("ok       fb: sources unchanged"), "{text}");
    // a changed target parameter
    let tree2 = dir.path().join("tree2");
    fixture_tree(&tree2);
    let hw = tree2.join("targets/h200/HARDWARE.toml");
    std::fs::write(
        &hw,
        std::fs::read_to_string(&hw)
            .unwrap()
            .replace("sm_count = 132", "sm_count = 131"),
    )
    .unwrap();
    let (code, text) = audit(&bin, &["--repo", tree2.to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("targets/h200/HARDWARE.toml changed") && text.contains("hw.sm_count"),
        "{text}"
    );
}
