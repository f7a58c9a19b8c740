//! Loading the CUDA backend for a CUDA target (feature `cuda`). The CUDA helper owns the backend's
//! constructor; this is the one place the server calls it.

use anyhow::{bail, Result};
use metrale_backend::Backend;
use metrale_core::target::TargetSpec;
use metrale_model::Model;

pub fn load(target: &TargetSpec, _model: &Model, slots: usize, ctx: usize) -> Result<Box<dyn Backend>> {
    // TODO(cuda helper): construct metrale_backend::cuda::CudaBackend from the embedded kernel set.
    bail!("target {} needs the CUDA backend, which is not wired into the server yet ({slots} slots x {ctx} tokens)", target.id)
}
