//! `targets/kernels.lock` is current: every blob the sources build for every target has the digest
//! the committed lock records; and a kernel change without a lock update fails, naming the blob and
//! the command to run.

mod toolchain_support;

use toolchain_support::*;

#[test]
fn the_committed_lock_matches_every_blob_the_sources_build() {
    if !toolchain_present("kernels.lock is current") {
        return;
    }
    let cache = target_dir().join("metrale-cache");
    let out = run_xtask(&["lock", "--check", "--cache", cache.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "targets/kernels.lock is stale (the output above names the blobs and the command to run)"
    );
}

#[test]
fn a_kernel_change_without_a_lock_update_fails_and_names_the_command() {
    if !toolchain_present("a stale lock fails") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    copy_sources(d.path());
    // the Metal target's blob is its rendered source: a code change there needs no compiler
    let t = d.path().join("kernels/metal/rmsnorm.metal.hbs");
    let text = std::fs::read_to_string(&t).unwrap();
    std::fs::write(
        &t,
        format!("{text}\nconstant constexpr uint LOCK_TEST = 1;\n"),
    )
    .unwrap();
    let cache = target_dir().join("metrale-cache");
    let out = run_xtask(&[
        "lock",
        "--check",
        "--repo",
        d.path().to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("changed  m3-max/smollm2-135m/q4_1 rmsnorm.metal"),
        "{err}"
    );
    assert!(err.contains("run `cargo xtask lock`"), "{err}");
    assert_eq!(
        err.matches("changed").count(),
        1,
        "only the edited blob differs: {err}"
    );
}
