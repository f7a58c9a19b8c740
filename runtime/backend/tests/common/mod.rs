//! Helpers shared by the test files (each file under tests/ is its own crate): where targets/ is,
//! a target's compiled kernels, and the backend contract (`contract`).
#![allow(dead_code)]

pub mod contract;

/// The repository's `targets/` folder: `$METRALE_TARGETS`, else the first `targets/` above the working
/// directory (tests run from the crate folder here and from the repo root on the GPU machine).
pub fn targets_root() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("METRALE_TARGETS") {
        return p.into();
    }
    let mut dir = std::env::current_dir().unwrap();
    loop {
        if dir.join("targets").is_dir() {
            return dir.join("targets");
        }
        if !dir.pop() {
            panic!("targets/ not found above the working directory; set METRALE_TARGETS");
        }
    }
}

/// The target named by `METRALE_CUDA_TARGET` ("h200/smollm2-135m/q4_1" by default), its spec, and
/// its compiled kernels from the folder `kernel_dir`.
#[cfg(feature = "cuda")]
pub fn target_kernels(
    kernel_dir: &str,
) -> (
    String,
    metrale_core::target::TargetSpec,
    metrale_backend::cuda::KernelSet,
) {
    use metrale_core::target::{TargetId, TargetSpec};
    let target =
        std::env::var("METRALE_CUDA_TARGET").unwrap_or_else(|_| "h200/smollm2-135m/q4_1".into());
    let id: TargetId = target.parse().expect("METRALE_CUDA_TARGET: hw/model/quant");
    let spec = TargetSpec::load(&targets_root(), &id).expect("target spec");
    let set = metrale_backend::cuda::KernelSet::from_dir(std::path::Path::new(kernel_dir), &spec)
        .expect("kernel set");
    (target, spec, set)
}
