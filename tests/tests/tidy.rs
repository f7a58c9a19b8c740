//! `cargo xtask tidy`: the repository keeps its house rules (a `//!` paragraph on every Rust file, no
//! machine path, every METRALE_* variable in ARCHITECTURE.md's Configuration table, every CUDA
//! signature rendered from the ABI), and a tree that breaks each rule is refused naming the file.

mod toolchain_support;

use toolchain_support::*;

#[test]
fn the_repository_is_tidy() {
    let out = run_xtask(&["tidy"]);
    assert!(
        out.status.success(),
        "cargo xtask tidy found problems (listed above)"
    );
}

#[test]
fn each_rule_is_enforced_naming_the_file() {
    let d = tempfile::tempdir().unwrap();
    copy_sources(d.path());
    std::fs::copy(
        repo().join("ARCHITECTURE.md"),
        d.path().join("ARCHITECTURE.md"),
    )
    .unwrap();
    std::fs::write(d.path().join("undocumented.rs"), "fn main() {}\n").unwrap();
    let home = format!("/{}/{}", "home", "someone/model.gguf");
    std::fs::write(d.path().join("script.sh"), format!("m={home}\n")).unwrap();
    std::fs::write(
        d.path().join("reads.py"),
        format!(
            "import os\nos.environ.get('{}')\n",
            ["METRALE", "UNLISTED"].join("_")
        ),
    )
    .unwrap();
    let t = d.path().join("kernels/cuda/embed.cu.hbs");
    let text = std::fs::read_to_string(&t).unwrap();
    std::fs::write(
        &t,
        text.replace(
            "{{{abi.params.embed}}}",
            "const void* qs, const void* sc, const int* tokens, float* x, int ntok",
        ),
    )
    .unwrap();
    let out = run_xtask(&["tidy", "--repo", d.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for want in [
        "undocumented.rs: does not open with a `//!` paragraph",
        "script.sh:1: names a machine path (/home/<user>)",
        &format!("reads.py: uses {}", ["METRALE", "UNLISTED"].join("_")),
        "kernels/cuda/embed.cu.hbs: entry `embed` does not render its signature from the ABI",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    assert!(err.contains("tidy: 4 problem(s)"), "{err}");
}
