//! Loading the CUDA backend for a CUDA target (feature `cuda`): the one place the server builds a
//! `metrale_backend::cuda::CudaBackend`, and reads `METRALE_CUDA_TUNING` (`Tuning::parse`). `CudaBackend::from_registry` takes the kernels from this
//! binary's embedded pack and checks them against the embedded attestation's digests
//! (`Registry::verify`) before anything is loaded.

use anyhow::{Context, Result};
use metrale_backend::cuda::{CudaBackend, CudaOptions, Tuning};
use metrale_backend::{Backend, KvConfig};
use metrale_core::target::TargetSpec;
use metrale_model::Model;

pub fn load(
    target: &TargetSpec,
    model: &Model,
    kv: KvConfig,
    cli: &crate::cli::Cli,
) -> Result<Box<dyn Backend>> {
    let (slots, ctx) = (kv.slots, kv.slot_capacity);
    // the runtime choices: the measured defaults, with METRALE_CUDA_TUNING on top (start-up is the
    // one place the server reads it)
    let tuning = Tuning::default()
        .parse(&std::env::var(Tuning::ENV).unwrap_or_default())
        .map_err(anyhow::Error::msg)?;
    let opts = CudaOptions {
        device: 0,
        slots,
        slot_capacity: ctx,
        // 0: every slot at full context, or what fits in the memory fraction
        kv_blocks: kv.blocks,
        memory_fraction: cli.gpu_memory_utilization,
        // verification rows for the proposals --speculative makes
        max_drafts: match cli.speculative {
            Some(_) => cli.num_speculative_tokens,
            None => 0,
        },
        tuning,
        ..CudaOptions::default()
    };
    let b = CudaBackend::from_registry(model, opts).with_context(|| {
        format!(
            "loading the CUDA backend of {} ({slots} slots x {ctx} tokens)",
            target.id
        )
    })?;
    eprintln!("  {}", b.decode_summary());
    Ok(Box::new(b))
}
