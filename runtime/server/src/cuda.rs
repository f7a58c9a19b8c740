//! Loading the CUDA backend for a CUDA target (feature `cuda`): the one place the server builds a
//! `metrale_backend::cuda::CudaBackend`. The kernels come from this binary's embedded pack, checked
//! against the embedded attestation's digests (`Registry::verify`) before anything is loaded.

use anyhow::{Context, Result};
use metrale_backend::cuda::{CudaBackend, CudaOptions, Dims, KernelBlob, KernelSet};
use metrale_backend::Backend;
use metrale_core::target::TargetSpec;
use metrale_model::Model;

pub fn load(target: &TargetSpec, model: &Model, slots: usize, ctx: usize) -> Result<Box<dyn Backend>> {
    let reg = metrale_kernels::registry();
    reg.verify().context("checking the embedded kernels against the embedded attestation")?;
    let arch = target
        .hardware
        .cubin_arch
        .clone()
        .with_context(|| format!("target {} names no cubin_arch in its HARDWARE.toml", target.id))?;
    let blobs = reg
        .kernels
        .iter()
        .map(|k| {
            let blob = KernelBlob {
                name: k.name.clone(),
                cubin: k.cubin.to_vec(),
                ptx: (!k.ptx.is_empty()).then(|| k.ptx.as_bytes().to_vec()),
            };
            (k.name.clone(), blob)
        })
        .collect();
    let set = KernelSet { target: target.id.to_string(), arch, blobs };
    let opts = CudaOptions { device: 0, slots, slot_capacity: ctx, ..CudaOptions::default() };
    let b = CudaBackend::new(
        &set,
        Dims::from_shape(&target.model),
        &target.quant.weights,
        &target.quant.embedding,
        &model.config,
        &model.weights,
        opts,
    )
    .with_context(|| format!("loading the CUDA backend of {} ({slots} slots x {ctx} tokens)", target.id))?;
    Ok(Box::new(b))
}
