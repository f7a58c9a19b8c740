//! `cargo xtask bench-record DIR/metrale-server --model PATH`: benchmark a built server binary through its
//! own HTTP API and write `bench/records/<date>-<target>.json`, a record that carries the binary's
//! embedded attestation (from `metrale-server --attestation`) and its sha256, so a published number can
//! be traced to the exact kernels that produced it.
//!
//! What is measured (medians of `--reps` repetitions after one warm-up request):
//! - `cold_start_s`: process spawn to the first streamed token of the first request;
//! - `decode_tok_s` (batch 1): one streamed completion of `--gen-tokens` tokens with `ignore_eos`,
//!   (tokens - 1) / (last token time - first token time), i.e. pure decode, prefill excluded;
//! - `prefill_tok_s`: a prompt of exactly `--prompt-tokens` token ids and `max_tokens = 1`, prompt tokens
//!   over the request's wall time (HTTP overhead included, so a lower bound). Each repetition
//!   rotates the prompt so that the server's prefix cache cannot serve it, and any token the cache
//!   did serve (`vllm:prefix_cache_hits_total`) is left out of the count;
//! - `concurrent`: for each `--concurrency` value c (default 1, 16, 64, 256), c simultaneous streams
//!   of `--gen-tokens` tokens after prompts of `--stream-prompt-tokens` token ids (each stream's
//!   prompt rotated so that no two share a prefix): total generated tokens over wall time (the
//!   prompts' prefill included), the median inter-token latency and time to first token, c over the
//!   median inter-token latency (`itl_tok_s`: the rate while every stream decodes, to set beside an
//!   in-process decode step), the server's engine steps in the run with their mean wall time and
//!   the part inside the backend (`engine`: `metrale:engine_*`; the difference is the host's work
//!   between steps), and the streams that failed (counted and the first error kept, not hidden).
//!
//! With `--peer DIR` (llama.cpp's `llama-bench` and `llama-batched-bench` in DIR), the same run then
//! benchmarks llama.cpp on the same GGUF (`--peer-model`, default `--model`) after our server has
//! stopped: `llama-bench` pp and tg (the same prompt and generation lengths, `--reps` repetitions),
//! and `llama-batched-bench` at the concurrency levels (prompt `--stream-prompt-tokens`, generation
//! `--gen-tokens`). The record keeps the peer's build (from llama-bench's JSON), its exact command
//! lines, its figures, and our figure over theirs for each (`peer.ratios`).
//!
//! `--memory-bandwidth-gbs B` adds the batch-1 floor: a decode step reads every weight byte once, so
//! decode is at most B / (the model file's bytes) tokens per second (`floors`).
//!
//! Everything goes over loopback HTTP to the real binary: the numbers are what a client sees. The
//! server inherits this process's environment, so the record lists the variables that steer it
//! (`METRALE_CUDA_TUNING`, `CUDA_*`) under `settings.server_env`.
//!
//! The record names the kernels lock it was built from: `kernels_lock.sha256` is the digest of
//! `targets/kernels.lock` (of `--lock`, by default the one in the working directory's source tree),
//! and `kernels_lock.matches_binary` says whether every blob the binary embeds has the digest that
//! lock records for its target. Files are named, not located (no machine path enters a record), and
//! a record is never overwritten (a second one of the same day and target gets a suffix).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

#[derive(clap::Args)]
pub struct Args {
    /// The server binary to benchmark (e.g. dist/h200-smollm2-135m-q4_1/metrale-server).
    pub binary: PathBuf,
    /// The checkpoint to serve (GGUF file or HF directory).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt length of the prefill measurement, in tokens.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated per decode measurement.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repetitions of each measurement (the record keeps all and reports the median).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Concurrency levels for the throughput measurement, comma-separated (empty: skip).
    #[arg(long, default_value = "1,16,64,256")]
    pub concurrency: String,
    /// Prompt length of each concurrent stream, in tokens.
    #[arg(long, default_value_t = 128)]
    pub stream_prompt_tokens: usize,
    /// llama.cpp's binaries folder (llama-bench, llama-batched-bench): run the peer in the same run
    /// and write its figures beside ours.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// The GGUF the peer runs (default: --model, which must then be a GGUF file).
    #[arg(long)]
    pub peer_model: Option<PathBuf>,
    /// Extra arguments for both peer benchmarks (e.g. "-t 16"); the defaults are `-ngl 99 -fa 1`.
    #[arg(long, allow_hyphen_values = true)]
    pub peer_args: Option<String>,
    /// Where the peer's build came from, recorded as given (its binaries may not know their commit,
    /// e.g. "llama.cpp vendored in llama-cpp-python 0.3.36 (ggml 0.25.3)").
    #[arg(long)]
    pub peer_source: Option<String>,
    /// Measured memory bandwidth in GB/s: adds the batch-1 decode floor (weight bytes / bandwidth).
    #[arg(long, value_parser = positive_rate)]
    pub memory_bandwidth_gbs: Option<f64>,
    /// Folder for the record.
    #[arg(long, default_value = "bench/records")]
    pub out: PathBuf,
    /// Extra arguments passed to the server (e.g. "--parallel 16").
    #[arg(long, allow_hyphen_values = true)]
    pub server_args: Option<String>,
    /// The kernels lock to name (default: targets/kernels.lock of the working directory, else of
    /// this repository).
    #[arg(long)]
    pub lock: Option<PathBuf>,
}

/// The lock's digest and whether the binary's blobs (the attestation's `kernels/*` subjects) are
/// the ones it records for `target`, with the blobs that differ.
/// FLOPs of one token's matrix products (`ModelShape::matmul_flops_per_token`: the active experts
/// alone, where routed) of the model shape the attested kernels were compiled for; `None` where the attestation names none (a CPU
/// target has no kernels).
fn matmul_flops_per_token(attestation: &Value) -> Option<f64> {
    let kernels = attestation
        .pointer("/predicate/buildDefinition/internalParameters/kernels")?
        .as_object()?;
    let m = kernels
        .values()
        .find_map(|k| k.pointer("/manifest/params/model"))?;
    let shape: metrale_core::target::ModelShape = serde_json::from_value(m.clone()).ok()?;
    Some(shape.matmul_flops_per_token())
}

fn lock_check(lock: &Path, target: &str, attestation: &Value) -> Result<Value> {
    let text = std::fs::read_to_string(lock)
        .with_context(|| format!("reading the kernels lock {}", lock.display()))?;
    let locked: std::collections::BTreeMap<String, String> = crate::lock::parse(&text)?
        .into_iter()
        .filter(|((t, _), _)| t == target)
        .map(|((_, blob), d)| (blob, d))
        .collect();
    let mut embedded = std::collections::BTreeMap::new();
    for s in attestation["subject"].as_array().into_iter().flatten() {
        if let (Some(name), Some(digest)) = (s["name"].as_str(), s["digest"]["sha256"].as_str()) {
            if let Some(blob) = name.strip_prefix("kernels/") {
                embedded.insert(blob.to_string(), digest.to_string());
            }
        }
    }
    let mut differ: Vec<String> = embedded
        .iter()
        .filter(|(b, d)| locked.get(*b) != Some(*d))
        .map(|(b, _)| b.clone())
        .collect();
    differ.extend(
        locked
            .keys()
            .filter(|b| !embedded.contains_key(*b))
            .cloned(),
    );
    Ok(json!({
        "sha256": hex::encode(Sha256::digest(text.as_bytes())),
        "blobs": embedded.len(),
        "matches_binary": differ.is_empty(),
        "differing_blobs": differ,
    }))
}

/// A file's name, for a record (its location is the machine's business).
fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// The `--concurrency` list: comma-separated positive integers, empty for none.
fn parse_concurrency(text: &str) -> Result<Vec<usize>> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s.parse::<usize>() {
            Ok(c) if c > 0 => Ok(c),
            _ => bail!("--concurrency: `{s}` is not a positive integer (give e.g. 1,16,64,256, or \"\" for none)"),
        })
        .collect()
}

/// `--memory-bandwidth-gbs`: a positive, finite rate.
fn positive_rate(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!(
            "`{s}`: give the GPU's measured copy rate in GB/s, a positive number (a decode \
             step's floor is its bytes over it)"
        )),
    }
}

pub fn run(args: Args) -> Result<()> {
    let levels = parse_concurrency(&args.concurrency)?;
    let peer_model = match (&args.peer, &args.peer_model) {
        (None, _) => None,
        (Some(_), Some(m)) => Some(m.clone()),
        (Some(_), None) if args.model.is_file() => Some(args.model.clone()),
        (Some(_), None) => bail!(
            "--peer needs a GGUF: --model {} is not a file; give --peer-model FILE.gguf",
            args.model.display()
        ),
    };
    if let Some(dir) = &args.peer {
        for b in ["llama-bench", "llama-batched-bench"] {
            if !dir.join(b).is_file() {
                bail!("--peer {}: no {b} there (build llama.cpp's llama-bench and llama-batched-bench targets)", dir.display());
            }
        }
    }
    let binary = args.binary.canonicalize().with_context(|| {
        format!(
            "server binary {} not found; build one with `cargo xtask build-target`",
            args.binary.display()
        )
    })?;
    let attestation = command_output(&binary, &["--attestation"])?;
    let attestation: Value = serde_json::from_str(&attestation)
        .with_context(|| format!("{} --attestation did not print JSON", binary.display()))?;
    let target_info = command_output(&binary, &["--target-info"]).unwrap_or_default();
    let binary_sha256 = hex::encode(Sha256::digest(std::fs::read(&binary)?));

    let mut server_args: Vec<String> = vec!["--model".into(), args.model.display().to_string()];
    let max_c = levels.iter().copied().max().unwrap_or(1);
    if let Some(extra) = &args.server_args {
        server_args.extend(extra.split_whitespace().map(String::from));
    } else if max_c > 1 {
        server_args.extend(["--parallel".to_string(), max_c.to_string()]);
    }
    let port = free_port()?;
    server_args.extend([
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
    ]);
    let base = format!("http://127.0.0.1:{port}");

    eprintln!("starting {} {}", binary.display(), server_args.join(" "));
    let spawned = Instant::now();
    let server = Server(
        Command::new(&binary)
            .args(&server_args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?,
    );
    wait_healthy(&base, Duration::from_secs(120))?;
    let health_s = spawned.elapsed().as_secs_f64();
    let first = stream_completion(&base, &[1, 2, 3], 2)?;
    let cold_start_s = spawned.elapsed().as_secs_f64() - (first.total_s - first.first_token_s);
    eprintln!("healthy after {health_s:.2} s, first token after {cold_start_s:.2} s");

    let prompt = prompt_tokens(&base, args.prompt_tokens)?;
    let short_prompt = &prompt[..prompt.len().min(8)];

    // Warm-up, then the measurements.
    stream_completion(&base, short_prompt, args.gen_tokens.min(16))?;
    let mut decode = Vec::new();
    for _ in 0..args.reps {
        let r = stream_completion(&base, short_prompt, args.gen_tokens)?;
        if r.tokens != args.gen_tokens {
            bail!(
                "asked for {} tokens with ignore_eos, got {}",
                args.gen_tokens,
                r.tokens
            );
        }
        decode.push(r.decode_tok_s());
    }
    let mut prefill = Vec::new();
    let mut prefill_cached = Vec::new();
    for rep in 0..args.reps {
        let mut p = prompt.clone();
        p.rotate_left(rep + 1);
        let hits = metric(&base, "vllm:prefix_cache_hits_total").unwrap_or(0.0);
        let t = Instant::now();
        let v = post(
            &base,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 1, "temperature": 0}),
        )?;
        let secs = t.elapsed().as_secs_f64();
        let n = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
        if n != prompt.len() {
            bail!("server counted {n} prompt tokens, sent {}", prompt.len());
        }
        let cached = (metric(&base, "vllm:prefix_cache_hits_total").unwrap_or(0.0) - hits) as usize;
        prefill.push((n - cached.min(n)) as f64 / secs);
        prefill_cached.push(cached);
    }
    let mut concurrent = Vec::new();
    let stream_prompt = prompt_tokens(&base, args.stream_prompt_tokens)?;
    // the engine's counters, from one read of /metrics
    let engine = |base: &str| {
        let text = metrics_text(base).unwrap_or_default();
        ["steps", "step_seconds", "backend_seconds"]
            .map(|n| metric_in(&text, &format!("metrale:engine_{n}_total")).unwrap_or(f64::NAN))
    };
    for &c in &levels {
        let e0 = engine(&base);
        let t = Instant::now();
        let results: Vec<Result<Stream>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..c)
                .map(|i| {
                    let mut p = stream_prompt.clone();
                    let n = p.len().max(1);
                    p.rotate_left(i % n);
                    let base = &base;
                    s.spawn(move || stream_completion(base, &p, args.gen_tokens))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("bench thread panicked"))
                .collect()
        });
        let wall = t.elapsed().as_secs_f64();
        let e1 = engine(&base);
        let steps = e1[0] - e0[0];
        let per_step_ms = |i: usize| (e1[i] - e0[i]) / steps * 1e3;
        let mut errors = Vec::new();
        let mut streams = Vec::new();
        for r in results {
            match r {
                Ok(s) => streams.push(s),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        let tokens: usize = streams.iter().map(|s| s.tokens).sum();
        let mut itl: Vec<f64> = streams.iter().flat_map(|s| s.gaps()).collect();
        let mut ttft: Vec<f64> = streams.iter().map(|s| s.first_token_s).collect();
        eprintln!(
            "{c} streams: {:.1} tok/s, {} failed",
            tokens as f64 / wall,
            errors.len()
        );
        let median_itl = median(&mut itl);
        concurrent.push(json!({
            "concurrency": c,
            "prompt_tokens": stream_prompt.len(),
            "output_tok_s": tokens as f64 / wall,
            "itl_tok_s": c as f64 / median_itl,
            "engine": {
                "steps": steps,
                "step_ms": per_step_ms(1),
                "backend_ms": per_step_ms(2),
                "host_ms": per_step_ms(1) - per_step_ms(2),
            },
            "median_itl_ms": median_itl * 1e3,
            "median_ttft_ms": median(&mut ttft) * 1e3,
            "max_ttft_ms": ttft.iter().copied().fold(0.0, f64::max) * 1e3,
            "streams_ok": streams.len(),
            "streams_failed": errors.len(),
            "first_error": errors.first(),
        }));
    }
    drop(server);

    // the matrix FLOPs the generated tokens stand for, per second of wall time (prompt tokens not
    // counted): the compute rate beside each concurrency level
    let flops_tok = matmul_flops_per_token(&attestation);
    if let Some(f) = flops_tok {
        for c in &mut concurrent {
            let rate = c["output_tok_s"].as_f64().unwrap_or(0.0);
            c["generated_tflops"] = json!(rate * f / 1e12);
        }
    }
    let decode_med = median(&mut decode.clone());
    let prefill_med = median(&mut prefill.clone());
    let peer = match (&args.peer, &peer_model) {
        (Some(dir), Some(gguf)) => Some(run_peer(
            dir,
            gguf,
            &args,
            &levels,
            (decode_med, prefill_med, &concurrent),
        )?),
        _ => None,
    };
    let model_bytes = std::fs::metadata(&args.model)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    let floors = match (args.memory_bandwidth_gbs, model_bytes) {
        (Some(bw), Some(bytes)) => json!({
            "memory_bandwidth_gbs": bw,
            "weight_bytes": bytes,
            "decode_tok_s": bw * 1e9 / bytes as f64,
            "decode_us_per_token": bytes as f64 / (bw * 1e9) * 1e6,
            "decode_fraction_of_floor": decode_med / (bw * 1e9 / bytes as f64),
        }),
        _ => Value::Null,
    };

    let target = attestation_target(&attestation).unwrap_or_else(|| "unknown".into());
    let lock = args.lock.clone().unwrap_or_else(|| {
        let here = crate::lock::lock_path(Path::new("."));
        if here.is_file() {
            here
        } else {
            crate::build_target::repo_root()
                .map(|r| crate::lock::lock_path(&r))
                .unwrap_or(here)
        }
    });
    let kernels_lock = lock_check(&lock, &target, &attestation)?;
    // the server's arguments as a record shows them: the model by file name
    let model_arg = args.model.display().to_string();
    let shown_args: Vec<String> = server_args
        .iter()
        .map(|a| {
            if *a == model_arg {
                file_name(&args.model)
            } else {
                a.clone()
            }
        })
        .collect();
    let date = time::OffsetDateTime::now_utc();
    let record = json!({
        "schema": "metrale.bench-record/v4",
        "date": date.format(&time::format_description::well_known::Rfc3339)?,
        "target": target,
        "binary": {"file": file_name(&binary), "sha256": binary_sha256},
        "model": {"file": file_name(&args.model), "sha256": file_sha256(&args.model).ok()},
        "kernels_lock": kernels_lock,
        "machine": machine(),
        "settings": {"prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "reps": args.reps,
                     "stream_prompt_tokens": args.stream_prompt_tokens,
                     "server_args": shown_args, "server_env": server_env(std::env::vars())},
        "metrics": {
            "cold_start_s": cold_start_s,
            "health_s": health_s,
            "decode_tok_s": decode_med,
            "decode_us_per_token": 1e6 / decode_med,
            "prefill_tok_s": prefill_med,
            "matmul_flops_per_token": flops_tok,
            "concurrent": concurrent,
        },
        "floors": floors,
        "peer": peer,
        "raw": {"decode_tok_s": decode, "prefill_tok_s": prefill, "prefill_cached_tokens": prefill_cached},
        "target_info": target_info,
        "attestation": attestation,
    });
    std::fs::create_dir_all(&args.out)?;
    let stem = format!("{}-{}", date.date(), target.replace('/', "-"));
    let file = (1..)
        .map(|i| match i {
            1 => args.out.join(format!("{stem}.json")),
            i => args.out.join(format!("{stem}-{i}.json")),
        })
        .find(|p| !p.exists())
        .expect("some suffix is free");
    std::fs::write(&file, serde_json::to_string_pretty(&record)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&record["metrics"])?);
    println!("{}", file.display());
    Ok(())
}

/// llama.cpp on the same GGUF (module docs): llama-bench (pp, tg) and llama-batched-bench at the
/// concurrency levels; `ours` = (decode tok/s, prefill tok/s, the concurrent entries) for the ratios.
fn run_peer(
    dir: &Path,
    gguf: &Path,
    args: &Args,
    levels: &[usize],
    (decode, prefill, concurrent): (f64, f64, &[Value]),
) -> Result<Value> {
    let extra: Vec<String> = match &args.peer_args {
        Some(a) => a.split_whitespace().map(String::from).collect(),
        None => vec!["-ngl".into(), "99".into(), "-fa".into(), "1".into()],
    };
    let model = gguf.display().to_string();
    let run = |bin: &str, a: &[String]| -> Result<String> {
        eprintln!("peer: {bin} {}", a.join(" "));
        let out = Command::new(dir.join(bin))
            .args(a)
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            bail!(
                "{bin} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    // the command lines as the record shows them: the model by file name
    let shown = |a: &[String]| -> Vec<String> {
        a.iter()
            .map(|x| {
                if *x == model {
                    file_name(gguf)
                } else {
                    x.clone()
                }
            })
            .collect()
    };
    let mut bench_args: Vec<String> = vec!["-m".into(), model.clone()];
    bench_args.extend(extra.iter().cloned());
    bench_args.extend(
        [
            "-p",
            &args.prompt_tokens.to_string(),
            "-n",
            &args.gen_tokens.to_string(),
            "-r",
            &args.reps.to_string(),
            "-o",
            "json",
        ]
        .map(String::from),
    );
    let bench: Value = serde_json::from_str(&run("llama-bench", &bench_args)?)
        .context("llama-bench -o json printed no JSON")?;
    let rows = bench.as_array().cloned().unwrap_or_default();
    let pick = |pp: usize, tg: usize| {
        rows.iter()
            .find(|r| {
                r["n_prompt"].as_u64() == Some(pp as u64) && r["n_gen"].as_u64() == Some(tg as u64)
            })
            .map(|r| {
                (
                    r["avg_ts"].as_f64().unwrap_or(f64::NAN),
                    r["stddev_ts"].as_f64().unwrap_or(f64::NAN),
                )
            })
    };
    let pp = pick(args.prompt_tokens, 0);
    let tg = pick(0, args.gen_tokens);
    let build = rows.first().map(|r| {
        json!({"commit": r["build_commit"], "number": r["build_number"], "backends": r["backends"],
               "gpu_info": r["gpu_info"], "cpu_info": r["cpu_info"]})
    });
    let mut batched = Value::Null;
    let mut batched_rows = Vec::new();
    if !levels.is_empty() {
        let (npp, ntg) = (args.stream_prompt_tokens, args.gen_tokens);
        let ctx = levels.iter().max().unwrap_or(&1) * (npp + ntg) + 256;
        let mut a: Vec<String> = vec!["-m".into(), model.clone()];
        a.extend(extra.iter().cloned());
        a.extend([
            "-c".to_string(),
            ctx.to_string(),
            "-b".into(),
            "2048".into(),
            "-ub".into(),
            "512".into(),
            "-npp".into(),
            npp.to_string(),
            "-ntg".into(),
            ntg.to_string(),
            "-npl".into(),
            levels
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ]);
        let text = run("llama-batched-bench", &a)?;
        batched_rows = parse_batched(&text);
        batched = json!({"args": shown(&a), "rows": batched_rows});
    }
    let ratio = |ours: f64, theirs: Option<f64>| theirs.map(|t| ours / t);
    let per_level: Vec<Value> = concurrent
        .iter()
        .map(|c| {
            let n = c["concurrency"].as_u64().unwrap_or(0);
            let theirs = batched_rows
                .iter()
                .find(|r| r["b"].as_u64() == Some(n))
                .and_then(|r| r["s_tg"].as_f64());
            json!({"concurrency": n, "ours_output_tok_s": c["output_tok_s"], "peer_s_tg": theirs,
                   "ratio": ratio(c["output_tok_s"].as_f64().unwrap_or(f64::NAN), theirs)})
        })
        .collect();
    Ok(json!({
        "name": "llama.cpp",
        "build": build,
        "source": args.peer_source,
        "model": {"file": file_name(gguf)},
        "llama_bench": {"args": shown(&bench_args), "results": rows.iter().map(|r| json!({
            "n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "avg_ts": r["avg_ts"], "stddev_ts": r["stddev_ts"],
            "samples_ts": r["samples_ts"]})).collect::<Vec<_>>()},
        "batched_bench": batched,
        "ratios": {
            "decode_vs_tg": ratio(decode, tg.map(|t| t.0)),
            "prefill_vs_pp": ratio(prefill, pp.map(|t| t.0)),
            "concurrent_vs_batched_s_tg": per_level,
            "note": "ours over HTTP (streams of the stated prompt and generation lengths, wall time); \
                     batched-bench in process (S_TG: its generation phase alone)",
        },
    }))
}

/// The rows of llama-batched-bench's table (`|  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s |
/// S_TG t/s | T s | S t/s |`), as objects; other lines are ignored.
fn parse_batched(text: &str) -> Vec<Value> {
    const KEYS: [&str; 10] = [
        "pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s",
    ];
    text.lines()
        .filter_map(|l| {
            let cells: Vec<f64> = l
                .trim()
                .strip_prefix('|')?
                .strip_suffix('|')?
                .split('|')
                .map(|c| c.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .ok()?;
            (cells.len() == KEYS.len()).then(|| {
                // the first four columns are counts
                let m: serde_json::Map<String, Value> = KEYS
                    .iter()
                    .zip(&cells)
                    .enumerate()
                    .map(|(i, (k, &v))| {
                        let v = if i < 4 { json!(v as u64) } else { json!(v) };
                        (k.to_string(), v)
                    })
                    .collect();
                Value::Object(m)
            })
        })
        .collect()
}

/// The environment variables that change what the server runs (its backend's runtime choices and
/// the CUDA driver's), sorted.
fn server_env(
    vars: impl Iterator<Item = (String, String)>,
) -> std::collections::BTreeMap<String, String> {
    // the server's runtime choices and the CUDA driver's; not paths, not the API key
    vars.filter(|(k, _)| k == "METRALE_CUDA_TUNING" || k.starts_with("CUDA_"))
        .collect()
}

/// Kills the server when the benchmark ends, on every path.
struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Stream {
    tokens: usize,
    first_token_s: f64,
    total_s: f64,
    /// Arrival time of each content chunk, seconds from the request.
    arrivals: Vec<f64>,
}

impl Stream {
    fn decode_tok_s(&self) -> f64 {
        let (first, last) = (self.arrivals[0], *self.arrivals.last().unwrap());
        (self.tokens.saturating_sub(1)) as f64 / (last - first).max(1e-9)
    }
    fn gaps(&self) -> Vec<f64> {
        self.arrivals.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// A streamed /v1/completions request with `ignore_eos`; one SSE chunk per token is expected (no stop
/// strings, so the server holds nothing back but incomplete UTF-8).
fn stream_completion(base: &str, prompt: &[u32], max_tokens: usize) -> Result<Stream> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let t = Instant::now();
    let resp = ureq::post(format!("{base}/v1/completions"))
        .send_json(&body)
        .context("streamed completion")?;
    let reader = BufReader::new(resp.into_body().into_reader());
    let mut arrivals = Vec::new();
    let mut tokens = None;
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("bad SSE chunk {data}"))?;
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = Some(n as usize);
        }
        if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
            arrivals.push(t.elapsed().as_secs_f64());
        }
    }
    let tokens = tokens.context("stream ended without a usage chunk")?;
    if arrivals.is_empty() {
        bail!("stream carried no tokens");
    }
    Ok(Stream {
        tokens,
        first_token_s: arrivals[0],
        total_s: t.elapsed().as_secs_f64(),
        arrivals,
    })
}

/// Exactly `n` token ids of ordinary English text, from the server's own tokenizer.
fn prompt_tokens(base: &str, n: usize) -> Result<Vec<u32>> {
    let text =
        "The quick brown fox jumps over the lazy dog while the engineers measure every kernel. "
            .repeat(n / 8 + 8);
    let v = post(base, "/tokenize", &json!({"content": text}))?;
    let mut ids: Vec<u32> = v["tokens"]
        .as_array()
        .context("/tokenize returned no tokens array")?
        .iter()
        .filter_map(|t| t.as_u64().map(|x| x as u32))
        .collect();
    if ids.len() < n {
        bail!("tokenizer gave {} tokens, need {n}", ids.len());
    }
    ids.truncate(n);
    Ok(ids)
}

fn post(base: &str, path: &str, body: &Value) -> Result<Value> {
    let mut resp = ureq::post(format!("{base}{path}"))
        .send_json(body)
        .with_context(|| format!("POST {path}"))?;
    Ok(resp.body_mut().read_json()?)
}

/// One sample of the server's /metrics (the first line starting with `name`); `None` when absent.
fn metric(base: &str, name: &str) -> Option<f64> {
    metric_in(&metrics_text(base)?, name)
}

/// The server's /metrics page.
fn metrics_text(base: &str) -> Option<String> {
    ureq::get(format!("{base}/metrics"))
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()
}

/// The value of the first sample of `name` on a /metrics page.
fn metric_in(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

fn wait_healthy(base: &str, timeout: Duration) -> Result<()> {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if let Ok(r) = ureq::get(format!("{base}/health")).call() {
            if r.status() == 200 {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("server did not report healthy within {timeout:?}")
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn command_output(binary: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(binary)
        .args(args)
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed: {}",
            binary.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn file_sha256(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

/// The "hw/model/quant" a statement was built for: the first string found under a key named
/// "target" anywhere in the attestation.
fn attestation_target(v: &Value) -> Option<String> {
    match v {
        Value::Object(m) => m
            .get("target")
            .and_then(|t| t.as_str().map(String::from))
            .or_else(|| m.values().find_map(attestation_target)),
        Value::Array(a) => a.iter().find_map(attestation_target),
        _ => None,
    }
}

fn machine() -> Value {
    let gpu = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
            "--format=csv,noheader",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("model name"))
            .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
    });
    json!({
        "gpu": gpu,
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    #[test]
    fn lock_check_names_the_blobs_that_differ_either_way() {
        let dir = tempfile::tempdir().unwrap();
        let lock = dir.path().join("kernels.lock");
        std::fs::write(
            &lock,
            "# c\nh/m/q a.cubin 11\nh/m/q a.ptx 22\nh/m/q b.cubin 33\nx/m/q a.cubin 99\n",
        )
        .unwrap();
        let att = |a: &str| {
            serde_json::json!({"subject": [
                {"name": "kernels/a.cubin", "digest": {"sha256": a}},
                {"name": "kernels/a.ptx", "digest": {"sha256": "22"}},
                {"name": "kernels/b.cubin", "digest": {"sha256": "33"}},
                {"name": "metrale-server", "digest": {"sha256": "00"}},
            ]})
        };
        let ok = super::lock_check(&lock, "h/m/q", &att("11")).unwrap();
        assert_eq!(ok["matches_binary"], true);
        assert_eq!(ok["blobs"], 3);
        assert_eq!(ok["sha256"].as_str().unwrap().len(), 64);
        let bad = super::lock_check(&lock, "h/m/q", &att("12")).unwrap();
        assert_eq!(bad["matches_binary"], false);
        assert_eq!(bad["differing_blobs"], serde_json::json!(["a.cubin"]));
        // a blob the lock has and the binary lacks
        let fewer = serde_json::json!({"subject": [{"name": "kernels/a.cubin", "digest": {"sha256": "11"}}]});
        let f = super::lock_check(&lock, "h/m/q", &fewer).unwrap();
        assert_eq!(
            f["differing_blobs"],
            serde_json::json!(["a.ptx", "b.cubin"])
        );
        // a target without kernels (cpu) matches an empty set
        let none =
            super::lock_check(&lock, "cpu/m/q", &serde_json::json!({"subject": []})).unwrap();
        assert_eq!(none["matches_binary"], true);
    }

    #[test]
    fn flops_per_token_come_from_the_attested_model_shape() {
        // the model block of the kernels' parameters, as build-target writes it
        let att = |model: &str| {
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../targets");
            let id = metrale_core::target::TargetId::new("cpu", model, "bf16");
            let spec = metrale_core::target::TargetSpec::load(&root, &id).unwrap();
            let m = serde_json::to_value(&spec.model).unwrap();
            serde_json::json!({"predicate": {"buildDefinition": {"internalParameters": {
                "kernels": {"gemm": {"manifest": {"params": {"model": m}}}}}}}})
        };
        // llama-3.1-8b: 15.01 GFLOP per token (layers and LM head)
        let f = super::matmul_flops_per_token(&att("llama-3.1-8b")).unwrap();
        assert!((f - 15.0095e9).abs() < 1e6, "{f}");
        // qwen3-30b-a3b: the router and 8 of 128 experts, 6.08 GFLOP
        let f = super::matmul_flops_per_token(&att("qwen3-30b-a3b")).unwrap();
        assert!((f - 6.0833e9).abs() < 1e6, "{f}");
        // no kernels (a CPU target): none
        assert!(super::matmul_flops_per_token(&serde_json::json!({"subject": []})).is_none());
    }

    #[test]
    fn bandwidth_must_be_a_positive_rate() {
        assert_eq!(super::positive_rate("3015").unwrap(), 3015.0);
        for bad in ["0", "-1", "inf", "NaN", "fast"] {
            let e = super::positive_rate(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("GB/s"), "{e}");
        }
    }

    #[test]
    fn concurrency_lists_parse_and_empty_means_none() {
        assert_eq!(
            super::parse_concurrency("1,16, 64,256").unwrap(),
            vec![1, 16, 64, 256]
        );
        assert!(super::parse_concurrency("").unwrap().is_empty());
        assert!(super::parse_concurrency(" ").unwrap().is_empty());
        let e = super::parse_concurrency("1,x").unwrap_err().to_string();
        assert!(e.contains("`x` is not a positive integer"), "{e}");
        assert!(super::parse_concurrency("0").is_err());
    }

    #[test]
    fn batched_bench_table_rows_parse() {
        let text = "main: n_kv_max = 4096\n\n|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n|   128 |    128 |    1 |    256 |    0.011 | 11636.36 |    0.291 |   439.86 |    0.302 |   847.68 |\n|   128 |    128 |   16 |   4096 |    0.120 | 17066.67 |    1.000 |  2048.00 |    1.120 |  3657.14 |\n";
        let rows = super::parse_batched(text);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1]["b"].as_u64(), Some(16));
        assert_eq!(rows[0]["s_tg"], 439.86);
    }

    #[test]
    fn server_env_keeps_only_the_knobs() {
        let vars = [
            ("PATH", "/bin"),
            ("METRALE_CUDA_TUNING", "run_ahead=off"),
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("HOME", "/r"),
            ("METRALE_MODEL", "/some/where.gguf"),
            ("METRALE_API_KEY", "secret"),
        ];
        let env = super::server_env(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        assert_eq!(
            env.into_iter().collect::<Vec<_>>(),
            [
                ("CUDA_VISIBLE_DEVICES".into(), "0".into()),
                ("METRALE_CUDA_TUNING".into(), "run_ahead=off".into())
            ]
        );
    }
}
