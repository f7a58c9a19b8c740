//! The `metrale-server` binary: parse the CLI, answer `--attestation` / `--target-info`, or serve.

use clap::Parser;
use metrale_server::cli::Cli;

fn main() {
    let cli = Cli::parse();
    if cli.attestation {
        let a = metrale_kernels::attestation_json();
        if a.trim().is_empty() {
            eprintln!(
                "error: this binary embeds no attestation: it is a generic build (cargo build), not a target \
                 build; make one with `cargo xtask build-target --hw <hw> --model <model> --quant <quant>`"
            );
            std::process::exit(1);
        }
        println!("{a}");
        return;
    }
    if cli.target_info {
        print!("{}", metrale_kernels::target_info());
        return;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(metrale_server::serve::run(cli));
    // Don't wait for a loader thread still reading the model (a signal during loading): the
    // HTTP side has already shut down gracefully inside run().
    rt.shutdown_background();
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
