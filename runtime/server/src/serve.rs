//! Start-up and shutdown: bind first (so `/health` answers 503 while loading), load the model, check
//! that this binary's target serves it, size the KV cache, start the engine, publish the ready state,
//! print what was set up, and serve until Ctrl-C / SIGTERM.
//!
//! Invariant: every start-up failure is one error line that says what was wrong and what to do, and
//! a non-zero exit; nothing half-started keeps listening.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use metrale_backend::Backend;
use metrale_core::target::{SamplingPreset as TomlPreset, TargetSpec};
use metrale_engine::{Engine, EngineConfig};
use metrale_model::{ChatTemplate, Model};

use crate::api::SamplingPreset;
use crate::cli::Cli;
use crate::state::{AppState, Served};

/// Sequences served at once when neither the flag nor the target says.
const DEFAULT_PARALLEL: usize = 4;
/// Per-sequence context when neither the flag nor the target says (capped by the model's own).
const DEFAULT_CTX: usize = 8192;

fn preset(p: &TomlPreset) -> SamplingPreset {
    SamplingPreset {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k.map(|k| k as i64),
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
    }
}

fn human_bytes(b: u64) -> String {
    let mib = b as f64 / (1024.0 * 1024.0);
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// Refuse a checkpoint this binary's target does not serve, naming both.
pub fn check_target(target: Option<&TargetSpec>, model: &Model) -> Result<()> {
    let Some(t) = target else { return Ok(()) };
    let (mt, hidden) = (&model.config.model_type, model.config.hidden);
    if t.serves(mt, hidden) {
        return Ok(());
    }
    let pairs: Vec<String> = t
        .model_types
        .iter()
        .map(|p| format!("({}, hidden {})", p.model_type, p.hidden_size))
        .collect();
    bail!(
        "this binary was built for target {} and serves {}; the checkpoint {} is ({mt}, hidden {hidden}). \
         Build a binary for it (`cargo xtask list-targets`, then `cargo xtask build-target --hw {} --model <model> \
         --quant <quant>`), or serve it with a plain `cargo build --release -p metrale-server` binary (cpu, any llama \
         checkpoint)",
        t.id,
        pairs.join(", "),
        model.path.display(),
        t.hardware.name,
    )
}

fn load_backend(
    target: Option<&TargetSpec>,
    model: &Model,
    slots: usize,
    ctx: usize,
    threads: usize,
) -> Result<Box<dyn Backend>> {
    let backend = target
        .map(|t| t.hardware.backend.to_string())
        .unwrap_or_else(|| "cpu".into());
    match backend.as_str() {
        "cpu" => {
            check_host_memory(model, slots, ctx)?;
            let b = metrale_backend::cpu::CpuBackend::load(model, slots, ctx, threads)
                .with_context(|| format!("loading the cpu backend ({slots} slots x {ctx} tokens)"))?;
            Ok(Box::new(b))
        }
        #[cfg(feature = "cuda")]
        "cuda" => crate::cuda::load(target.expect("cuda implies a target"), model, slots, ctx),
        other => bail!(
            "this binary's target uses the '{other}' backend, which this build does not include; rebuild it with \
             `cargo xtask build-target` (it enables the backend's feature)"
        ),
    }
}

/// Bytes per KV element in the cpu backend (f32 K and V).
const CPU_KV_ELEM_BYTES: u64 = 4;

/// `MemAvailable` of /proc/meminfo in bytes (None where it cannot be read).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuse a KV cache that does not fit in the host's available memory before allocating it (the
/// kernel's OOM killer would otherwise end the process, or a neighbour, mid-start).
fn check_host_memory(model: &Model, slots: usize, ctx: usize) -> Result<()> {
    let Some(avail) = mem_available() else {
        return Ok(());
    };
    let per_token = model.config.kv_elems_per_token() as u64 * CPU_KV_ELEM_BYTES;
    let need = per_token
        .saturating_mul(slots as u64)
        .saturating_mul(ctx as u64);
    // Leave a tenth of what is free (and the weights' working set) to the rest of the process.
    let budget = (avail - avail / 10).saturating_sub(model.weights.total_bytes());
    if need > budget {
        let fit_tokens = budget / per_token.max(1);
        bail!(
            "the KV cache for {slots} sequences x {ctx} tokens needs {}, but only {} of memory is available; \
             lower --parallel or --ctx-size (about {fit_tokens} tokens fit in all, e.g. --parallel {} --ctx-size {})",
            human_bytes(need),
            human_bytes(budget),
            (fit_tokens as usize / ctx).clamp(1, slots),
            (fit_tokens as usize / slots.min((fit_tokens as usize / ctx).max(1))).min(ctx).max(2),
        );
    }
    Ok(())
}

/// Run the server until a shutdown signal.
pub async fn run(cli: Cli) -> Result<()> {
    crate::cli::check(&cli)?;
    let model_path = cli.model.clone().expect("clap requires --model");
    let target = metrale_kernels::registry().target.clone();

    // Read the template before anything slow, so a bad file fails at once.
    let template_override = match &cli.chat_template {
        Some(p) => {
            let src = std::fs::read_to_string(p)
                .with_context(|| format!("reading --chat-template {}", p.display()))?;
            Some(ChatTemplate::new(&src).with_context(|| {
                format!("--chat-template {} is not a valid template", p.display())
            })?)
        }
        None => None,
    };

    let addr: SocketAddr = format!("{}:{}", cli.host, cli.port)
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            format!("{}:{}", cli.host, cli.port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or(())
        })
        .map_err(|_| {
            anyhow::anyhow!(
                "--host {} is not an address or a resolvable host name",
                cli.host
            )
        })?;
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!(
            "cannot listen on {addr}; is another server using port {}? pick another with --port",
            cli.port
        )
    })?;
    let local = listener.local_addr()?;

    let state = AppState::new(cli.api_key.clone());
    let app = crate::routes::router(state.clone());
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(async move {
        let mut rx = shutdown_rx;
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.wait_for(|v| *v).await;
            })
            .await
    });
    eprintln!(
        "metrale-server: listening on http://{local} (GET /health is 503 until the model is ready)"
    );
    if let Some(t) = &target {
        eprintln!("target: {} (backend {})", t.id, t.hardware.backend);
    } else {
        eprintln!("target: none compiled in (plain cargo build): cpu backend, any llama checkpoint, generic defaults");
    }

    let t0 = Instant::now();
    eprintln!("loading model {} ...", model_path.display());
    let load = tokio::task::spawn_blocking(move || -> Result<Served> {
        load(&cli, &model_path, target, template_override)
    });
    let served = tokio::select! {
        r = load => r.context("the loader thread panicked")??,
        _ = shutdown_signal() => {
            eprintln!("interrupted while loading");
            return Ok(());
        }
    };
    eprintln!(
        "ready in {:.1} s: model '{}', context {} tokens per sequence, KV capacity {} tokens, max concurrency {}",
        t0.elapsed().as_secs_f64(),
        served.name,
        served.ctx_size,
        served.kv_tokens,
        served.parallel
    );
    eprintln!(
        "serving on http://{local}/v1 (OpenAI API), /health, /metrics, /tokenize, /detokenize"
    );
    let _ = state.ready.set(Arc::new(served));

    tokio::select! {
        r = server => { r.context("server task")?.context("serving HTTP")?; }
        _ = shutdown_signal() => {
            eprintln!("shutting down");
            let _ = shutdown_tx.send(true);
        }
    }
    Ok(())
}

fn load(
    cli: &Cli,
    path: &std::path::Path,
    target: Option<TargetSpec>,
    template: Option<ChatTemplate>,
) -> Result<Served> {
    let t = Instant::now();
    let mut model =
        Model::load(path).with_context(|| format!("loading the model {}", path.display()))?;
    let c = &model.config;
    eprintln!(
        "  model: {} ({}, {} layers, hidden {}, vocab {}, context {}), weights {} [{:.1} s]",
        c.name,
        c.model_type,
        c.n_layers,
        c.hidden,
        c.vocab,
        c.max_context,
        human_bytes(model.weights.total_bytes()),
        t.elapsed().as_secs_f64()
    );
    check_target(target.as_ref(), &model)?;

    let behavior = target
        .as_ref()
        .map(|t| t.behavior.clone())
        .unwrap_or_default();
    let model_ctx = c.max_context.max(2);
    let ctx = match cli.ctx_size {
        Some(n) if n > model_ctx => {
            eprintln!(
                "  note: --ctx-size {n} exceeds the model's context {model_ctx}; using {model_ctx}"
            );
            model_ctx
        }
        Some(n) => n.max(2),
        None => behavior.ctx_size.unwrap_or(DEFAULT_CTX).min(model_ctx),
    };
    let parallel = cli
        .parallel
        .or(behavior.parallel)
        .unwrap_or(DEFAULT_PARALLEL);
    let threads = cli
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));

    let t = Instant::now();
    let backend = load_backend(target.as_ref(), &model, parallel, ctx, threads)?;
    let info = backend.info();
    eprintln!(
        "  backend: {} on {}, weights {}, KV cache {} ({} slots x {} tokens = {} tokens) [{:.1} s]",
        info.name,
        info.device,
        human_bytes(info.weight_bytes),
        human_bytes(info.kv_bytes),
        info.slots,
        info.slot_capacity,
        info.slots * info.slot_capacity,
        t.elapsed().as_secs_f64()
    );

    let chat_template = match template {
        // A template given on the command line sees the model's own bos/eos token texts.
        Some(t) => {
            let tk = &model.tokenizer;
            let text = |id: Option<u32>| id.and_then(|i| tk.token_text(i)).unwrap_or_default();
            Some(t.with_tokens(text(tk.bos()), text(tk.eos().first().copied())))
        }
        None => model.chat_template.take(),
    };
    if chat_template.is_none() {
        eprintln!("  note: the model has no chat template: /v1/chat/completions answers 400 until --chat-template FILE is given");
    }
    // Like llama-server: the file (or directory) name, which users recognise, unless --alias.
    let name = cli.alias.clone().unwrap_or_else(|| file_stem(path));
    let stop_tokens = c.eos.clone();
    let vocab = c.vocab;
    let engine = Engine::spawn(
        backend,
        EngineConfig {
            prefix_caching: !cli.no_prefix_caching,
            ..EngineConfig::default()
        },
    );
    let (chat_preset, completion_preset) = match &target {
        Some(t) => (preset(&t.sampling.chat), preset(&t.sampling.completion)),
        None => (SamplingPreset::default(), SamplingPreset::default()),
    };
    Ok(Served {
        model: Arc::new(model),
        chat_template,
        engine,
        name,
        ctx_size: info.slot_capacity,
        kv_tokens: info.slots * info.slot_capacity,
        parallel: info.slots,
        chat_preset,
        completion_preset,
        default_max_tokens: behavior.max_tokens,
        stop_tokens,
        vocab,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    })
}

fn file_stem(p: &std::path::Path) -> String {
    p.file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
