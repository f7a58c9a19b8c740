//! The host↔kernel ABI is checked when a target is built: a template whose entry point's parameters
//! are in another order than the host's declaration (metrale-abi) fails `build-target` naming the
//! kernel and the parameter; a kernel whose layout formula disagrees with the host's fails to
//! compile on the `static_assert` codegen renders into it.

mod toolchain_support;

use toolchain_support::*;

/// `build-target --kernels-only` of h200/smollm2-135m/q4_1 from a copy of the sources in which
/// `template`'s text has `from` replaced by `to`; returns (success, stderr).
fn build_with(template: &str, from: &str, to: &str) -> (bool, String) {
    let d = tempfile::tempdir().unwrap();
    copy_sources(d.path());
    let p = d.path().join(format!("kernels/cuda/{template}.cu.hbs"));
    let text = std::fs::read_to_string(&p).unwrap();
    assert!(text.contains(from), "{template}: `{from}` not found");
    std::fs::write(&p, text.replace(from, to)).unwrap();
    let cache = target_dir().join("metrale-cache");
    let out = run_xtask(&[
        "build-target",
        "--repo",
        d.path().to_str().unwrap(),
        "--hw",
        "h200",
        "--model",
        "smollm2-135m",
        "--quant",
        "q4_1",
        "--kernels-only",
        "--out",
        d.path().join("out").to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_template_with_swapped_parameters_fails_the_build_naming_kernel_and_parameter() {
    if !toolchain_present("ABI: swapped parameters") {
        return;
    }
    // the signature written by hand instead of rendered from the declaration, `ntok` moved before
    // `x` and `tokens` (the body still compiles: it uses the parameters by name)
    let (ok, err) = build_with(
        "embed",
        "embed({{{abi.params.embed}}})",
        "embed(const void* __restrict__ qs, const void* __restrict__ sc, int ntok, float* __restrict__ x, const int* __restrict__ tokens)",
    );
    assert!(
        !ok,
        "the build accepted a signature that disagrees with the ABI"
    );
    assert!(
        err.contains("kernel `embed` does not match the host's ABI")
            && err.contains("entry `embed`, parameter 2 `tokens`")
            && err.contains("the compiled kernel declares .u32"),
        "{err}"
    );
}

#[test]
fn a_kernel_formula_that_disagrees_with_the_host_layout_fails_to_compile() {
    if !toolchain_present("ABI: layout asserts") {
        return;
    }
    let (ok, err) = build_with(
        "attn_in",
        "constexpr int TB = mt::TokTile<HIDDEN>::N;",
        "constexpr int TB = mt::TokTile<HIDDEN>::N - 1;",
    );
    assert!(
        !ok,
        "the build accepted a token tile the host does not plan for"
    );
    assert!(
        err.contains("kernel `attn_in` failed to compile")
            && err.contains("tokens per block: the kernel's formula and the host's"),
        "{err}"
    );
}
