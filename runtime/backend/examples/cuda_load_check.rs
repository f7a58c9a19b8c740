//! Load check of compiled kernel sets on a real GPU: for every `<name>.cubin` in each
//! directory given, load it with cuModuleLoadData, read its entry points from the sibling
//! `<name>.ptx` (`.entry NAME(`), and find each function in the cubin module; then load the PTX itself
//! (the fallback path, JIT by the driver) and find each function there too. Prints one line per kernel
//! and exits 1 when anything fails.
//!
//! Usage: cargo run --release -p metrale-backend --features cuda --example cuda_load_check -- DIR...

/// The entry points a PTX declares (the ABI's parser, which `build-target` checks them with).
#[cfg(feature = "cuda")]
fn entries(ptx: &str) -> Vec<String> {
    metrale_backend::cuda::abi::ptx_entries(ptx)
        .into_iter()
        .map(|e| e.name)
        .collect()
}

#[cfg(feature = "cuda")]
fn main() {
    use cudarc::driver::CudaContext;
    use cudarc::nvrtc::Ptx;
    let dirs: Vec<String> = std::env::args().skip(1).collect();
    if dirs.is_empty() {
        eprintln!("usage: cuda_load_check DIR... (directories of <name>.cubin + <name>.ptx)");
        std::process::exit(2);
    }
    let ctx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot open CUDA device 0: {e}");
            std::process::exit(1);
        }
    };
    let cc = ctx.compute_capability().unwrap_or((0, 0));
    println!(
        "device 0: {} sm_{}{}",
        ctx.name().unwrap_or_default(),
        cc.0,
        cc.1
    );
    let (mut ok, mut bad) = (0usize, 0usize);
    for dir in &dirs {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot read {dir}: {e}"))
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
            .collect();
        names.sort();
        if names.is_empty() {
            println!("FAIL {dir}: no .cubin files");
            bad += 1;
        }
        for cubin_path in names {
            let ptx_path = cubin_path.with_extension("ptx");
            let label = format!(
                "{dir}/{}",
                cubin_path.file_name().unwrap().to_string_lossy()
            );
            let ptx = match std::fs::read_to_string(&ptx_path) {
                Ok(p) => p,
                Err(e) => {
                    println!("FAIL {label}: no PTX beside it ({e})");
                    bad += 1;
                    continue;
                }
            };
            let fns = entries(&ptx);
            if fns.is_empty() {
                println!("FAIL {label}: no .entry in its PTX");
                bad += 1;
                continue;
            }
            let cubin = std::fs::read(&cubin_path).unwrap();
            let mut line = String::new();
            let mut failed = false;
            for (kind, image) in [
                ("cubin", cubin),
                ("ptx", {
                    let mut p = ptx.clone().into_bytes();
                    p.push(0);
                    p
                }),
            ] {
                match ctx.load_module(Ptx::from_binary(image)) {
                    Ok(m) => {
                        for f in &fns {
                            if let Err(e) = m.load_function(f) {
                                line += &format!(" {kind}:{f}:MISSING({e})");
                                failed = true;
                            }
                        }
                        line += &format!(" {kind}:ok");
                    }
                    Err(e) => {
                        line += &format!(" {kind}:LOAD-FAILED({e})");
                        failed = true;
                    }
                }
            }
            println!(
                "{} {label} [{}]{line}",
                if failed { "FAIL" } else { "ok  " },
                fns.join(",")
            );
            if failed {
                bad += 1
            } else {
                ok += 1
            }
        }
    }
    println!("kernels loaded with every function found: {ok}; failed: {bad}");
    std::process::exit(if bad == 0 { 0 } else { 1 });
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("build with --features cuda");
    std::process::exit(2);
}
