//! xtask: metrale's build system and user commands (`cargo xtask <command>`). One module per command;
//! each module owns its clap `Args` and a `run` function. Shells out as little as possible: only to
//! `cargo` (to build the server binary), `pip` (to fetch wheels), `xcrun` (Metal) and `git` (the list
//! of tracked files `tidy` checks).

use clap::{Parser, Subcommand};

mod audit;
mod bench_record;
mod build_target;
mod fetch_model;
mod list_targets;
mod lock;
mod quantize;
mod quickstart;
mod synth_model;
mod tidy;
mod toolchain;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "metrale: build, audit and benchmark per-target LLM server binaries"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the pinned compilers (NVRTC + CUDA headers from PyPI wheels) into .toolchain/.
    Toolchain(toolchain::Args),
    /// Print the (hardware, model, quant) targets that can be built.
    ListTargets(list_targets::Args),
    /// Render, compile and attest a target's kernels and build its server binary.
    BuildTarget(build_target::Args),
    /// Check that a server binary's embedded kernels still match the sources.
    Audit(audit::Args),
    /// Run a benchmark with a built server binary and write a record carrying its attestation.
    BenchRecord(bench_record::Args),
    /// Write targets/kernels.lock (the sha256 of every kernel blob of every target), or --check it.
    Lock(lock::Args),
    /// Download a known model (checked by sha256) and print its path.
    FetchModel(fetch_model::Args),
    /// Re-encode a GGUF's matrices in another weight type or llama.cpp K-quant mix.
    Quantize(quantize::Args),
    /// A new user's first command: model + toolchain + build + serve + one answer.
    Quickstart(quickstart::Args),
    /// Write a checkpoint with a model's exact shapes, random weights and a real tokenizer.
    SynthModel(synth_model::Args),
    /// Check the house rules: `//!` docs, no machine paths, every METRALE_* in ARCHITECTURE.md.
    Tidy(tidy::Args),
}

fn main() {
    // Every NVRTC compile runs in a fresh xtask process (see metrale_codegen::worker).
    metrale_codegen::worker::serve_if_worker();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Toolchain(a) => toolchain::run(a),
        Cmd::ListTargets(a) => list_targets::run(a),
        Cmd::BuildTarget(a) => build_target::run(a),
        Cmd::Audit(a) => audit::run(a),
        Cmd::BenchRecord(a) => bench_record::run(a),
        Cmd::Lock(a) => lock::run(a),
        Cmd::FetchModel(a) => fetch_model::run(a),
        Cmd::Quantize(a) => quantize::run(a),
        Cmd::Quickstart(a) => quickstart::run(a),
        Cmd::SynthModel(a) => synth_model::run(a),
        Cmd::Tidy(a) => tidy::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(match e.downcast_ref::<xtask_exit::Exit>() {
            Some(x) => x.0,
            None => 1,
        });
    }
}

/// A command that wants a specific exit status (e.g. `audit` returns 1 on a mismatch after printing
/// its report) returns `Err(Exit(code).into())`.
mod xtask_exit {
    #[derive(Debug)]
    pub struct Exit(pub i32);
    impl std::fmt::Display for Exit {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "exit status {}", self.0)
        }
    }
    impl std::error::Error for Exit {}
}
