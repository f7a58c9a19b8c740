//! The backend contract (`common/contract.rs`), one body, on every backend:
//! - the CPU backend on a small random model (always);
//! - the CPU backend on the real default model (`METRALE_MODEL`);
//! - the CUDA backend on the real default model (`METRALE_MODEL`, `METRALE_CUDA_KERNELS`,
//!   `METRALE_CUDA_TARGET`, a GPU; feature `cuda`), as the GPU machine runs it.
//!
//! Without a model, kernels or GPU, the corresponding test prints why and passes.

mod common;

use metrale_backend::cpu::{synthetic, CpuBackend};
use metrale_core::dtype::DType;

fn real_model(test: &str) -> Option<metrale_model::Model> {
    let Some(p) = std::env::var_os("METRALE_MODEL") else {
        eprintln!("{test}: skipped: METRALE_MODEL (the default model's GGUF) is unset");
        return None;
    };
    Some(metrale_model::Model::load(std::path::Path::new(&p)).expect("load METRALE_MODEL"))
}

fn chat(m: &metrale_model::Model, text: &str) -> Vec<u32> {
    let t = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    m.tokenizer.encode(&t, false, true).expect("tokenize")
}

#[test]
fn cpu_backend_on_a_random_model() {
    for dt in [DType::Q4_1, DType::BF16] {
        let mut b = synthetic::tiny_backend(
            dt,
            3,
            common::contract::SLOTS,
            common::contract::CAPACITY,
            2,
        );
        common::contract::check(&mut b, 50, &[1, 7, 3, 49, 20, 11], &[4, 5, 6, 30, 2]);
    }
}

#[test]
fn cpu_backend_on_the_real_model() {
    let Some(m) = real_model("contract, cpu, real model") else {
        return;
    };
    let mut b = CpuBackend::load(&m, common::contract::SLOTS, common::contract::CAPACITY, 0)
        .expect("cpu backend");
    let (a, c) = (
        chat(&m, "What is the capital of France?"),
        chat(&m, "Name a colour."),
    );
    common::contract::check(&mut b, m.config.vocab, &a, &c);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_backend_on_the_real_model() {
    use metrale_backend::cuda::{device_count, CudaBackend, CudaOptions};
    let Ok(kdir) = std::env::var("METRALE_CUDA_KERNELS") else {
        eprintln!("contract, cuda: skipped: METRALE_CUDA_KERNELS is unset");
        return;
    };
    if device_count() == 0 {
        eprintln!("contract, cuda: skipped: no CUDA device");
        return;
    }
    let Some(m) = real_model("contract, cuda") else {
        return;
    };
    let (_, _, set) = common::target_kernels(&kdir);
    let mut b = CudaBackend::new(
        &set,
        &m.config,
        &m.weights,
        CudaOptions {
            slots: common::contract::SLOTS,
            slot_capacity: common::contract::CAPACITY,
            // each slot its own run of blocks (`metrale_backend::slot_blocks`)
            kv_blocks: common::contract::SLOTS
                * metrale_backend::blocks_for(common::contract::CAPACITY),
            ..Default::default()
        },
    )
    .expect("cuda backend");
    let (a, c) = (
        chat(&m, "What is the capital of France?"),
        chat(&m, "Name a colour."),
    );
    common::contract::check(&mut b, m.config.vocab, &a, &c);
}
