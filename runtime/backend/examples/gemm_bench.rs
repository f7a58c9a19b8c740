//! The Hopper GEMMs of a target (bf16, or q4_1 on W4A16), product by product (numbers, not a test): QKV, O, gate/up,
//! down and the LM head over chunks of `--tokens` tokens, each timed alone
//! (`CudaBackend::profile_gemms`): the bf16 conversion and product as the forward pass runs them,
//! `gemm_hopper.cu.hbs`'s kernel, the warp-specialised launch the plan's estimate picks and, with
//! `--sweep`, every other tile and K split. Beside each: TFLOP/s, the weights' bytes over the time
//! and the two floors (the FLOPs at the dense bf16 peak, the weight bytes at the copy rate measured
//! first). cuBLAS on the same shapes is `bench/gemm/cublas.py`'s, in the same call
//! (`ci/gpu/gemm.sh`); `bench/gemm/table.py` joins the two.
//!
//! Before each token count, one prefill chunk of that many tokens runs through the backend (its
//! activations are what the products read: real values, not zeros).
//!
//! Usage: gemm_bench MODEL.gguf KERNEL_DIR TARGET_ID [--tokens 16,64,256,512,4096] [--sweep]
//! [--out FILE]   (reads `METRALE_TARGETS` and `METRALE_CUDA_TUNING` as cuda_bench does)

#[cfg(feature = "cuda")]
mod args;

#[cfg(feature = "cuda")]
fn main() {
    use metrale_backend::cuda::{CudaBackend, CudaOptions, KernelSet, Tuning};
    use metrale_backend::sampler::SamplingParams;
    use metrale_backend::{Backend, SeqStep};
    use metrale_core::target::{TargetId, TargetSpec};

    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: gemm_bench MODEL.gguf KERNEL_DIR TARGET_ID [--tokens 16,64,256,512,4096] [--sweep] [--out FILE]");
        std::process::exit(2);
    }
    let tokens = args::counts(&args, "--tokens", "16,64,256,512,4096");
    let sweep = args.iter().any(|a| a == "--sweep");
    let out = args::opt(&args, "--out", "");
    let id: TargetId = args[3].parse().unwrap_or_else(|e| {
        eprintln!("TARGET_ID: {e}");
        std::process::exit(2)
    });
    let root = std::env::var("METRALE_TARGETS").unwrap_or_else(|_| "targets".into());
    let spec = TargetSpec::load(std::path::Path::new(&root), &id).expect("target");
    let set = KernelSet::from_dir(std::path::Path::new(&args[2]), &spec).expect("kernels");
    let tuning = Tuning::default()
        .parse(&std::env::var(Tuning::ENV).unwrap_or_default())
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
    let model = metrale_model::Model::load(std::path::Path::new(&args[1])).expect("model");
    let maxt = tokens.iter().copied().max().unwrap_or(1).max(16);
    let mut b = CudaBackend::new(
        &set,
        &model.config,
        &model.weights,
        CudaOptions {
            slots: 2,
            slot_capacity: maxt,
            kv_blocks: 2 * metrale_backend::blocks_for(maxt),
            max_step_tokens: maxt,
            tuning,
            ..Default::default()
        },
    )
    .expect("backend");
    let copy_gbs = b.copy_rate_gbs(2 << 30).unwrap();
    // the dense bf16 tensor-core peak of an H200 SXM (NVIDIA's datasheet): the FLOP floor
    const PEAK_TFLOPS: f64 = 989.0;
    eprintln!("{:?}; device-to-device copy {copy_gbs:.0} GB/s", b.info());
    let greedy = SamplingParams::default();
    let table = metrale_backend::slot_blocks(0, maxt);
    let mut lines = Vec::new();
    for &n in &tokens {
        // one real chunk of n tokens first: its activations are what the products read
        let ids: Vec<u32> = (0..n).map(|i| (i * 7919 % 1000 + 100) as u32).collect();
        b.release(0);
        b.step(&[SeqStep {
            slot: 0,
            blocks: &table,
            start_pos: 0,
            tokens: &ids,
            history: &ids,
            sampling: &greedy,
            draw: 0,
            want_logits: false,
            allowed: None,
            drafted: 0,
        }])
        .expect("prefill chunk");
        for t in b.profile_gemms(n, sweep).expect("profile") {
            let flops = 2.0 * (t.rows * t.k * t.ntok) as f64;
            let wbytes = t.weight_bytes as f64;
            let tflops = flops / t.us / 1e6;
            let floor_us = (flops / (PEAK_TFLOPS * 1e6)).max(wbytes / (copy_gbs * 1e3));
            let (cfg, splits) = t.tma.map_or((String::new(), 0), |p| {
                let (bm, bn) = metrale_backend::cuda::abi::layout::TMA_CONFIGS[p.cfg];
                (format!("{bm}x{bn}"), p.splits)
            });
            eprintln!(
                "{:8} n={:5} {:9} {:8} splits={} {:9.2} us {:7.1} TFLOP/s {:7.0} GB/s floor {:8.2} us{}{}",
                t.product,
                t.ntok,
                t.kernel,
                cfg,
                splits,
                t.us,
                tflops,
                wbytes / t.us / 1e3,
                floor_us,
                if t.planned { "  <- runs" } else { "" },
                if t.estimate_pick { "  (estimate's pick)" } else { "" },
            );
            lines.push(format!(
                "{{\"product\": \"{}\", \"rows\": {}, \"k\": {}, \"ntok\": {}, \"kernel\": \"{}\", \"tile\": \"{cfg}\", \"splits\": {splits}, \"planned\": {}, \"estimate_pick\": {}, \"us\": {:.3}, \"tflops\": {tflops:.2}, \"weight_gbs\": {:.1}, \"floor_us\": {floor_us:.3}, \"copy_gbs\": {copy_gbs:.1}, \"tuning\": \"{:?}\"}}",
                t.product, t.rows, t.k, t.ntok, t.kernel, t.planned, t.estimate_pick, t.us,
                wbytes / t.us / 1e3, tuning
            ));
        }
    }
    // the greedy pick after the LM head: the arg-max of each logits row alone
    for &n in &tokens {
        let (split, one, floor, splits) = b.profile_argmax(n, copy_gbs).expect("argmax");
        eprintln!(
            "argmax   n={n:5} {split:9.2} us over {splits} blocks a row, {one:9.2} us one block a row, floor {floor:8.2} us (the logits' bytes)"
        );
    }
    if !out.is_empty() {
        std::fs::write(&out, lines.join("\n") + "\n").expect("write --out");
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("build with --features cuda");
    std::process::exit(2);
}
