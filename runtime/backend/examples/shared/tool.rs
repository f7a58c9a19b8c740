//! What the examples that compare numbers (golden_check, perplexity, spec_bench) share: their argument lookup,
//! and opening a backend on a checkpoint: the CPU backend, or the CUDA backend on a target's kernels
//! (`cuda` feature; METRALE_TARGETS names the targets/ folder, default `targets`;
//! METRALE_CUDA_TUNING is read).

use metrale_backend::{Backend, KvConfig, KvDtype};

/// The value after flag `name` in `args`, if any.
pub fn opt<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// The CPU backend on `m`: `slots` slots of `cap` positions.
pub fn cpu_backend(
    m: &metrale_model::Model,
    kv: KvDtype,
    exact: bool,
    (slots, cap): (usize, usize),
) -> Box<dyn Backend> {
    let mut b = metrale_backend::cpu::CpuBackend::load_kv(
        m,
        KvConfig {
            dtype: kv,
            ..KvConfig::per_slot(slots, cap)
        },
        0,
    )
    .expect("cpu backend");
    b.set_exact_activations(exact);
    Box::new(b)
}

/// The CUDA backend of `target` on the kernels in `dir`, `slots` slots of `cap` positions, verifying up
/// to `max_drafts` proposed tokens a step. A target whose kernels read fp8 layer matrices
/// (`[quant] weights = "fp8"`) given a checkpoint without them has its layer matrices quantized at
/// load first, as the server does (`metrale_model::fp8::quantize_at_load`: a backend made from
/// `m` afterwards reads the same FP8 weights).
#[cfg(feature = "cuda")]
pub fn cuda_backend(
    m: &mut metrale_model::Model,
    dir: &str,
    target: &str,
    (slots, cap): (usize, usize),
    max_drafts: usize,
) -> (Box<dyn Backend>, KvDtype) {
    use metrale_backend::cuda::{CudaBackend, CudaOptions, KernelSet};
    use metrale_core::target::{TargetId, TargetSpec};
    use std::path::Path;
    let id: TargetId = target.parse().expect("target: hw/model/quant");
    let root = std::env::var("METRALE_TARGETS").unwrap_or_else(|_| "targets".into());
    let spec = TargetSpec::load(Path::new(&root), &id).expect("target");
    let kv = spec.quant.kv_dtype();
    if metrale_model::fp8::needs_quantizing(&m.config, &spec.quant.weights) {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let q = metrale_model::fp8::quantize_at_load(m, threads).expect("quantize at load to fp8");
        eprintln!("quantized at load: {} matrices to fp8 e4m3", q.matrices);
    }
    let set = KernelSet::from_dir(Path::new(dir), &spec).expect("kernels");
    let tuning = metrale_backend::cuda::Tuning::default()
        .parse(&std::env::var(metrale_backend::cuda::Tuning::ENV).unwrap_or_default())
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
    let b = CudaBackend::new(
        &set,
        &m.config,
        &m.weights,
        CudaOptions {
            slots,
            slot_capacity: cap,
            kv_blocks: slots * metrale_backend::blocks_for(cap),
            max_drafts,
            tuning,
            ..Default::default()
        },
    )
    .expect("cuda backend");
    (Box::new(b), kv)
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_backend(
    _: &mut metrale_model::Model,
    _: &str,
    _: &str,
    _: (usize, usize),
    _: usize,
) -> (Box<dyn Backend>, KvDtype) {
    eprintln!("--cuda needs this example built with --features cuda");
    std::process::exit(2)
}
