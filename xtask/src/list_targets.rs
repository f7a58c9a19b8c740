//! `cargo xtask list-targets`: the (hardware, model, quant) matrix under targets/, each target parsed
//! and checked (an invalid one is listed with its error, and the command then fails).

use anyhow::Result;
use metrale_core::target::{list_targets, TargetSpec};

#[derive(clap::Args)]
pub struct Args {
    /// Source tree holding targets/ (default: this repository).
    #[arg(long)]
    repo: Option<std::path::PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let repo = crate::build_target::repo_or_root(&args.repo)?;
    let root = repo.join("targets");
    let ids = list_targets(&root)?;
    let mut bad = 0;
    println!(
        "{:<8} {:<7} {:<14} {:<6} {:<10} {:>4}  kernels",
        "hw", "backend", "model", "quant", "arch", "SMs"
    );
    for id in &ids {
        match TargetSpec::load(&root, id) {
            Ok(s) => {
                let h = &s.hardware;
                println!(
                    "{:<8} {:<7} {:<14} {:<6} {:<10} {:>4}  {}",
                    id.hw,
                    h.backend.to_string(),
                    id.model,
                    id.quant,
                    h.cubin_arch
                        .clone()
                        .or(h.metal_std.clone())
                        .unwrap_or_else(|| "-".into()),
                    h.sm_count
                        .or(h.gpu_cores)
                        .map(|n| n.to_string())
                        .unwrap_or_else(|| "-".into()),
                    s.kernels.len()
                );
            }
            Err(e) => {
                bad += 1;
                println!("{id}: INVALID: {e}");
            }
        }
    }
    println!("{} targets; build one with: cargo xtask build-target --hw <hw> --model <model> --quant <quant>", ids.len());
    if bad > 0 {
        anyhow::bail!("{bad} target(s) are invalid (see above)");
    }
    Ok(())
}
