//! Start-up and shutdown: bind first (so `/health` answers 503 while loading), load the model, check
//! that this binary's target serves it, size the KV cache, start the engine and the preprocessing
//! pool, measure the memory budget, publish the ready state, print what was set up, and serve until
//! Ctrl-C / SIGTERM; then drain.
//!
//! Drain: stop accepting, let every open connection finish its request (streams included) for up
//! to `--shutdown-timeout`, then end what is left with an error (an error event and `[DONE]` for a
//! stream, a 503 for a whole response) and exit non-zero. A second signal ends the wait at once.
//! SIGHUP is logged and ignored (a closed terminal does not stop the server).
//!
//! Invariant: every start-up failure is one error line that says what was wrong and what to do, and
//! a non-zero exit; nothing half-started keeps listening.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use metrale_backend::{Backend, KvConfig, KV_BLOCK};
use metrale_core::target::{SamplingPreset as TomlPreset, TargetSpec};
use metrale_engine::{Engine, EngineConfig};
use metrale_model::{ChatMessage, ChatTemplate, Model, RenderError, RenderLimits};
use tokio::sync::watch;

use crate::api::SamplingPreset;
use crate::budget::MemoryBudget;
use crate::cli::Cli;
use crate::listen::{self, Connections, ListenConfig};
use crate::pool::Pool;
use crate::state::{AppState, Limits, Served};

/// Sequences served at once when neither the flag nor the target says.
const DEFAULT_PARALLEL: usize = 4;
/// Per-sequence context when neither the flag nor the target says (capped by the model's own).
const DEFAULT_CTX: usize = 8192;
/// Connections served at once when --max-connections is not given (and the open-file limit allows).
const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// File descriptors kept for everything but connections (model files, pipes, the listener).
const FD_RESERVE: u64 = 128;
/// Memory kept outside request reservations: the runtime's own buffers, plus each connection's
/// request-head buffer and task.
const HEADROOM_BYTES: u64 = 128 << 20;
const HEADROOM_PER_CONNECTION: u64 = 80 << 10;
/// Template instructions (minijinja fuel) per token of context: a conversation that fits has at
/// most one message per token, and real templates spend tens of instructions per message.
const TEMPLATE_FUEL_PER_TOKEN: u64 = 2_000;
const TEMPLATE_FUEL_BASE: u64 = 100_000;
/// After the drain deadline, how long the ended requests get to send their last bytes.
const ABORT_GRACE: Duration = Duration::from_secs(5);

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
         --quant <quant>`), or serve it with a plain `cargo build --release -p metrale-server` binary (cpu, a checkpoint of \
         any supported family)",
        t.id,
        pairs.join(", "),
        model.path.display(),
        t.hardware.name,
    )
}

fn load_backend(
    target: Option<&TargetSpec>,
    model: &Model,
    kv: KvConfig,
    cli: &Cli,
) -> Result<Box<dyn Backend>> {
    let backend = target
        .map(|t| t.hardware.backend.to_string())
        .unwrap_or_else(|| "cpu".into());
    let threads = cli
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    match backend.as_str() {
        "cpu" => {
            check_host_memory(model, kv)?;
            let b = metrale_backend::cpu::CpuBackend::load_kv(model, kv, threads).with_context(|| {
                format!(
                    "loading the cpu backend ({} slots x {} tokens, a KV pool of {} tokens)",
                    kv.slots,
                    kv.slot_capacity,
                    kv.pool_blocks() * KV_BLOCK
                )
            })?;
            Ok(Box::new(b))
        }
        #[cfg(feature = "cuda")]
        "cuda" => crate::cuda::load(target.expect("cuda implies a target"), model, kv, cli),
        other => bail!(
            "this binary's target uses the '{other}' backend, which this build does not include; rebuild it with \
             `cargo xtask build-target` (it enables the backend's feature)"
        ),
    }
}

/// Refuse a KV cache that does not fit in the host's available memory before allocating it (the
/// kernel's OOM killer would otherwise end the process, or a neighbour, mid-start).
fn check_host_memory(model: &Model, kv: KvConfig) -> Result<()> {
    let Some(avail) = crate::budget::host_available() else {
        return Ok(());
    };
    let hd = model.config.head_dim.max(1);
    let per_token =
        (model.config.kv_elems_per_token() / hd) as u64 * kv.dtype.vector_bytes(hd) as u64;
    let tokens = (kv.pool_blocks() * KV_BLOCK) as u64;
    let need = per_token.saturating_mul(tokens);
    // Leave a tenth of what is free (and the weights' working set) to the rest of the process.
    let budget = (avail - avail / 10).saturating_sub(model.weights.total_bytes());
    if need > budget {
        let fit_tokens = budget / per_token.max(1);
        let ctx = kv.slot_capacity;
        bail!(
            "the KV cache of {tokens} tokens ({} sequences x {ctx}) needs {}, but only {} of memory is available; \
             lower --kv-cache-tokens, --parallel or --ctx-size (about {fit_tokens} tokens fit in all, e.g. \
             --kv-cache-tokens {fit_tokens}, or --parallel {} --ctx-size {})",
            kv.slots,
            human_bytes(need),
            human_bytes(budget),
            (fit_tokens as usize / ctx).clamp(1, kv.slots),
            (fit_tokens as usize / kv.slots.min((fit_tokens as usize / ctx).max(1)))
                .min(ctx)
                .max(2),
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
            let src = metrale_model::files::read_to_string(p)
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

    let nofile = listen::raise_nofile_limit();
    let fd_room = nofile.saturating_sub(FD_RESERVE).max(16) as usize;
    let max_connections = match cli.max_connections {
        Some(n) => {
            if n > fd_room {
                eprintln!(
                    "note: --max-connections {n} is more than the open-file limit ({nofile}) allows; \
                     connections past about {fd_room} will not be accepted (raise `ulimit -n`)"
                );
            }
            n
        }
        None => DEFAULT_MAX_CONNECTIONS.min(fd_room),
    };
    let client_timeout = Duration::from_secs(cli.client_timeout);
    let conns = Arc::new(Connections::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let (abort_tx, abort_rx) = watch::channel(false);
    let state = AppState::new(
        (
            crate::cli::api_keys(&cli)?,
            cli.cors_origins
                .iter()
                .map(|o| o.trim().to_string())
                .filter(|o| !o.is_empty())
                .collect(),
            !cli.no_webui,
        ),
        Limits {
            max_queue: cli.max_queue,
            client_timeout,
        },
        conns.clone(),
        abort_rx,
    );
    let app = crate::routes::router(state.clone());
    let accept = tokio::spawn(listen::serve(
        listener,
        app,
        ListenConfig {
            max_connections,
            client_timeout,
        },
        conns.clone(),
        stop_rx,
    ));
    ignore_sighup();
    eprintln!(
        "metrale-server: listening on http://{local} (GET /health is 503 until the model is ready)"
    );
    if let Some(t) = &target {
        eprintln!("target: {} (backend {})", t.id, t.hardware.backend);
    } else {
        eprintln!("target: none compiled in (plain cargo build): cpu backend, a checkpoint of any supported family, generic defaults");
    }

    let t0 = Instant::now();
    eprintln!("loading model {} ...", model_path.display());
    let shutdown_timeout = Duration::from_secs(cli.shutdown_timeout);
    let load = tokio::task::spawn_blocking(move || -> Result<Served> {
        load(
            &cli,
            &model_path,
            target,
            template_override,
            max_connections,
        )
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

    shutdown_signal().await;
    eprintln!(
        "shutting down: accepting no new connections; waiting up to {} s (--shutdown-timeout) for the \
         requests of {} open connections to finish",
        shutdown_timeout.as_secs(),
        conns.open()
    );
    let _ = stop_tx.send(true);
    let _ = accept.await;
    let drained = tokio::select! {
        r = tokio::time::timeout(shutdown_timeout, conns.wait_closed()) => r.is_ok(),
        _ = shutdown_signal() => {
            eprintln!("second signal: ending the requests still running now");
            false
        }
    };
    if drained {
        eprintln!("drained: every request finished");
        return Ok(());
    }
    let left = conns.open();
    let _ = abort_tx.send(true);
    let _ = tokio::time::timeout(ABORT_GRACE, conns.wait_closed()).await;
    bail!(
        "the drain did not finish: {left} connections still had requests running after {} s \
         (--shutdown-timeout); they were ended with an error",
        shutdown_timeout.as_secs()
    )
}

/// Render a small conversation under the template's limits, so that a template with runaway loops
/// fails at start-up, naming its limit, instead of on every request.
fn probe_template(t: &ChatTemplate) -> Result<()> {
    let msgs = [
        ChatMessage::new("user", "Hello"),
        ChatMessage::new("assistant", "Hi. How can I help?"),
        ChatMessage::new("user", "What is the capital of France?"),
    ];
    match t.render_bounded(&msgs, true) {
        Err(RenderError::OutOfFuel { fuel }) => bail!(
            "the chat template runs past its limit of {fuel} instructions on a 3-message conversation: it \
             has a runaway loop; fix it, or give another with --chat-template FILE"
        ),
        Err(RenderError::TooLong { max_bytes }) => bail!(
            "the chat template renders a 3-message conversation to more than {max_bytes} bytes, more than \
             the context can hold; fix it, or give another with --chat-template FILE"
        ),
        // A template may refuse some conversations on purpose (raise_exception); that is per request.
        _ => Ok(()),
    }
}

/// The KV cache's element type: `--kv-cache-dtype`, or the target's (`auto`). A kernel backend
/// reads the type its target was built for and no other.
fn kv_dtype(cli: &Cli, target: Option<&TargetSpec>) -> Result<metrale_backend::KvDtype> {
    let built = target.map(|t| t.quant.kv_dtype()).unwrap_or_default();
    let asked = match cli.kv_cache_dtype.as_str() {
        "auto" => return Ok(built),
        s => metrale_backend::KvDtype::parse(s).expect("clap checked the value"),
    };
    match target {
        Some(t) if t.hardware.backend.to_string() != "cpu" && asked != built => bail!(
            "--kv-cache-dtype {}: this binary's kernels ({}) read a {built} KV cache; leave the flag \
             out (auto), or build a target with [quant] kv = \"{asked}\" (an fp8 cache: the cpu \
             backend, or a cuda target such as h200/llama-3.1-8b/bf16-fp8kv)",
            cli.kv_cache_dtype,
            t.id,
        ),
        _ => Ok(asked),
    }
}

/// `--quantization fp8`, or a target whose kernels read fp8 layer matrices given a checkpoint
/// without them: the layer matrices quantized at load; or an FP8 checkpoint, said.
fn quantize(cli: &Cli, target: Option<&TargetSpec>, model: &mut Model) -> Result<()> {
    let asked = cli.quantization.as_deref() == Some("fp8");
    let for_kernels = target
        .is_some_and(|t| metrale_model::fp8::needs_quantizing(&model.config, &t.quant.weights));
    if asked || for_kernels {
        let why = if asked {
            "--quantization fp8"
        } else {
            "this binary's kernels read fp8 layer matrices (quantized at load)"
        };
        let t = Instant::now();
        let threads = cli
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let q = metrale_model::fp8::quantize_at_load(model, threads).context(why)?;
        if q.matrices > 0 {
            eprintln!(
                "  quantized at load: {} matrices to fp8 e4m3, one scale per output channel, \
                 dynamic per-token activation scales ({} -> {}) [{:.1} s]",
                q.matrices,
                human_bytes(q.bytes_before),
                human_bytes(q.bytes_after),
                t.elapsed().as_secs_f64()
            );
            return Ok(());
        }
    }
    if let Some(a) = model.config.fp8 {
        eprintln!("  weights: fp8 e4m3 from the checkpoint, one scale per output channel, {a}");
    }
    Ok(())
}

fn load(
    cli: &Cli,
    path: &std::path::Path,
    target: Option<TargetSpec>,
    template: Option<ChatTemplate>,
    max_connections: usize,
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
    quantize(cli, target.as_ref(), &mut model)?;
    let c = &model.config;

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
    if let Some(t) = cli.kv_cache_tokens.filter(|&t| t < ctx) {
        bail!(
            "--kv-cache-tokens {t} cannot hold one sequence of the context ({ctx} tokens); give at least {ctx} \
             or lower --ctx-size"
        );
    }
    let kv = KvConfig {
        slots: parallel,
        slot_capacity: ctx,
        blocks: cli.kv_cache_tokens.map_or(0, metrale_backend::blocks_for),
        dtype: kv_dtype(cli, target.as_ref())?,
    };
    let t = Instant::now();
    let backend = load_backend(target.as_ref(), &model, kv, cli)?;
    let info = backend.info();
    let kv_tokens = info.kv_blocks * KV_BLOCK;
    let load_s = t.elapsed().as_secs_f64();
    eprintln!(
        "  backend: {} on {}, weights {} loaded in {load_s:.2} s ({:.1} GB/s: read, repacked, uploaded)",
        info.name,
        info.device,
        human_bytes(info.weight_bytes),
        info.weight_bytes as f64 / 1e9 / load_s.max(1e-9),
    );
    eprintln!(
        "  KV cache: {} blocks of {KV_BLOCK} tokens = {kv_tokens} tokens, {} {}; holds {} sequences at the full \
         context of {} tokens; {} slots (more sequences than fit wait, or are recomputed later)",
        info.kv_blocks,
        human_bytes(info.kv_bytes),
        info.kv_dtype,
        kv_tokens / info.slot_capacity.max(1),
        info.slot_capacity,
        info.slots,
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
    let ctx_size = info.slot_capacity;
    let prompt_byte_cap = crate::prepare::prompt_byte_cap(&model.tokenizer, ctx_size);
    let chat_template = match chat_template {
        Some(t) => {
            let t = t.with_limits(RenderLimits {
                fuel: TEMPLATE_FUEL_BASE + TEMPLATE_FUEL_PER_TOKEN * ctx_size as u64,
                max_bytes: prompt_byte_cap,
            });
            probe_template(&t)?;
            Some(t)
        }
        None => None,
    };
    if chat_template.is_none() {
        eprintln!("  note: the model has no chat template: /v1/chat/completions answers 400 until --chat-template FILE is given");
    }
    // Like llama-server: the file (or directory) name, which users recognise, unless --alias.
    let name = cli.alias.clone().unwrap_or_else(|| file_stem(path));
    let stop_tokens = c.eos.clone();
    // structured output: the token trie of the tokenizer (a failure disables it, saying so)
    let t = Instant::now();
    let grammars = match c.eos.first() {
        Some(&eos) => {
            match crate::grammar::Grammars::new(&model.tokenizer, c.vocab, eos) {
                Ok(g) => {
                    eprintln!(
                        "  structured output: grammar tables of {} tokens built in {:.2} s",
                        c.vocab,
                        t.elapsed().as_secs_f64()
                    );
                    Some(Arc::new(g))
                }
                Err(e) => {
                    eprintln!("  note: structured output is off: building its grammar tables failed: {e:#}");
                    None
                }
            }
        }
        None => {
            eprintln!("  note: structured output is off: the model names no end-of-sequence token");
            None
        }
    };
    let vocab = c.vocab;
    let prefill_chunk = match cli.long_prefill_token_threshold {
        0 => backend.info().prefill_chunk.unwrap_or(usize::MAX),
        cap => cap,
    }
    .min(cli.max_num_batched_tokens);
    eprintln!(
        "  scheduler: up to {} tokens a step (decodes first, then prompt chunks of up to {prefill_chunk} a request)",
        cli.max_num_batched_tokens,
    );
    let speculation = speculation(cli, &backend.info())?;
    if let Some(sp) = &speculation {
        eprintln!("  speculative decoding: {}", sp.describe());
    }
    let draft = match &cli.draft_model {
        Some(p) => Some(load_draft(p, &model, kv, cli)?),
        None => None,
    };
    let engine = Engine::spawn_with_draft(
        backend,
        draft,
        EngineConfig {
            prefix_caching: !cli.no_prefix_caching,
            speculation,
            max_step_tokens: cli.max_num_batched_tokens,
            prefill_chunk,
        },
    );
    let (chat_preset, completion_preset) = match &target {
        Some(t) => (preset(&t.sampling.chat), preset(&t.sampling.completion)),
        None => (SamplingPreset::default(), SamplingPreset::default()),
    };
    let model = Arc::new(model);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let warm = model.clone();
    let pool = Pool::new(
        (threads / 2).clamp(2, 8),
        Arc::new(move || {
            let _ = warm
                .tokenizer
                .encode("Warm up: 1234, <|im_start|>. ", false, true);
        }),
    );
    // Measured last, once everything the process keeps is allocated.
    let budget = Arc::new(MemoryBudget::measure(
        cli.max_memory,
        HEADROOM_BYTES + HEADROOM_PER_CONNECTION * max_connections as u64,
    ));
    if budget.total < 64 << 20 {
        bail!(
            "the memory budget leaves {} MiB for requests ({}); give the server more memory (--max-memory, \
             or the container's limit) or lower --max-connections",
            budget.total >> 20,
            budget.describe()
        );
    }
    eprintln!(
        "  requests: memory budget {}; prompts up to {prompt_byte_cap} bytes; {} preprocessing threads; \
         queue {}; {max_connections} connections; client timeout {} s",
        budget.describe(),
        pool.threads(),
        cli.max_queue,
        cli.client_timeout
    );
    let hidden = model.config.hidden;
    let embeddings = if cli.embeddings {
        let (pooling, why) =
            embedding_pooling(cli.pooling.as_deref(), model.config.pooling.as_deref());
        eprintln!(
            "  embeddings: /v1/embeddings pools with {} ({why})",
            pooling.name()
        );
        Some(pooling)
    } else {
        None
    };
    let reasoning = crate::reasoning::Format::resolve(
        &cli.reasoning_format,
        chat_template.as_ref().map(|t| t.source()),
    )
    .map_err(anyhow::Error::msg)?;
    if reasoning == crate::reasoning::Format::Deepseek {
        eprintln!("  reasoning: the text between <think> and </think> is returned as reasoning_content (--reasoning-format)");
    }
    let mut stop_tokens = stop_tokens;
    if reasoning == crate::reasoning::Format::Harmony {
        // a harmony generation ends at <|return|> or <|call|>, whatever the file's EOS says
        let ids: Vec<u32> = crate::harmony::STOP_TEXTS
            .iter()
            .filter_map(|t| model.tokenizer.token_to_id(t))
            .collect();
        if ids.len() != crate::harmony::STOP_TEXTS.len() {
            anyhow::bail!(
                "--reasoning-format harmony: the vocabulary lacks {} (a gpt-oss model has them); \
                 serve with --reasoning-format none",
                crate::harmony::STOP_TEXTS.join(" or ")
            );
        }
        for id in ids {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
        eprintln!("  reasoning: gpt-oss's harmony channels: analysis as reasoning_content, final as content, messages to functions.* as tool calls (--reasoning-format)");
    }
    Ok(Served {
        model,
        pool,
        budget,
        chat_template,
        engine,
        name,
        target: metrale_kernels::registry()
            .target
            .as_ref()
            .map(|t| t.id.to_string()),
        ctx_size,
        kv_tokens,
        parallel: info.slots,
        chat_preset,
        completion_preset,
        default_max_tokens: behavior.max_tokens,
        stop_tokens,
        vocab,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        grammars,
        tool_format: crate::tools::ToolFormat::parse(behavior.tool_call_format.as_deref())
            .map_err(anyhow::Error::msg)?,
        sse_keepalive: (cli.sse_keepalive > 0).then(|| Duration::from_secs(cli.sse_keepalive)),
        log_json: cli.log_format == crate::cli::LogFormat::Json,
        embeddings,
        hidden,
        reasoning,
    })
}

fn file_stem(p: &std::path::Path) -> String {
    p.file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
}

/// Log SIGHUP instead of dying of it (a closed terminal or a reload signal must not stop serving).
fn ignore_sighup() {
    #[cfg(unix)]
    if let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                eprintln!("SIGHUP received and ignored (SIGTERM or Ctrl-C stops the server)");
            }
        });
    }
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

/// The pooling of `--embeddings`: the flag's, else the model's (`<arch>.pooling_type`) where the
/// server has it, else mean; with the reason, for the start-up line.
fn embedding_pooling(
    flag: Option<&str>,
    model: Option<&str>,
) -> (metrale_backend::Pooling, String) {
    use metrale_backend::Pooling;
    if let Some(p) = flag.and_then(|f| Pooling::parse(f).ok()) {
        return (p, "--pooling".into());
    }
    match model {
        Some(m) => match Pooling::parse(m) {
            Ok(p) => (p, "the model's pooling_type".into()),
            Err(_) => (
                Pooling::Mean,
                format!("the model's pooling_type is {m}, which this server does not pool by; --pooling mean|last chooses"),
            ),
        },
        None => (Pooling::Mean, "the default; --pooling last for the last token's".into()),
    }
}

/// The draft model of `--speculative draft` on the CPU backend, a KV run per slot of the
/// target's context in the target's KV type: refused unless its tokenizer is the target's, token
/// for token.
fn load_draft(
    path: &std::path::Path,
    target: &Model,
    kv: KvConfig,
    cli: &Cli,
) -> Result<Box<dyn Backend>> {
    let t = Instant::now();
    let draft =
        Model::load(path).with_context(|| format!("loading the draft model {}", path.display()))?;
    let (a, b) = (&target.tokenizer, &draft.tokenizer);
    if a.vocab_size() != b.vocab_size() || draft.config.vocab != target.config.vocab {
        bail!(
            "the draft model {} has a vocabulary of {} tokens, the model {}: a draft model must share \
             the model's tokenizer",
            path.display(),
            draft.config.vocab,
            target.config.vocab
        );
    }
    if let Some(id) =
        (0..a.vocab_size() as u32).find(|&i| a.token_bytes_ref(i) != b.token_bytes_ref(i))
    {
        bail!(
            "the draft model {} has another tokenizer: token {id} is {:?} there and {:?} in the model; \
             a draft model must share the model's tokenizer",
            path.display(),
            String::from_utf8_lossy(b.token_bytes_ref(id)),
            String::from_utf8_lossy(a.token_bytes_ref(id))
        );
    }
    let kv = KvConfig {
        dtype: kv.dtype, // the target's: the draft's attention rounds as the target's does
        ..KvConfig::per_slot(kv.slots, kv.slot_capacity)
    };
    let backend = load_backend(None, &draft, kv, cli)
        .with_context(|| format!("loading the draft model {}", path.display()))?;
    eprintln!(
        "  draft model: {} ({} layers, hidden {}), weights {}, on {} [{:.1} s]",
        draft.config.name,
        draft.config.n_layers,
        draft.config.hidden,
        human_bytes(draft.weights.total_bytes()),
        backend.info().device,
        t.elapsed().as_secs_f64()
    );
    Ok(backend)
}

/// The engine's speculative decoding from the flags, refused by name on a backend that cannot
/// verify proposed tokens.
fn speculation(
    cli: &Cli,
    info: &metrale_engine::BackendInfo,
) -> Result<Option<metrale_engine::Speculation>> {
    let Some(method) = cli.speculative.as_deref() else {
        return Ok(None);
    };
    if !info.verifies_drafts {
        bail!(
            "--speculative {method}: the {} backend does not verify proposed tokens yet; \
             run without --speculative",
            info.name
        );
    }
    let proposer = match method {
        "ngram" => metrale_engine::Proposer::Ngram {
            min: cli.prompt_lookup_min,
            max: cli.prompt_lookup_max,
        },
        "draft" => metrale_engine::Proposer::Draft,
        o => bail!("--speculative {o} is not supported; the choices are ngram, draft"),
    };
    Ok(Some(metrale_engine::Speculation {
        tokens: cli.num_speculative_tokens,
        proposer,
    }))
}

#[cfg(test)]
mod tests {
    use super::embedding_pooling;
    use metrale_backend::Pooling;

    #[test]
    fn the_flag_wins_then_the_models_pooling_then_mean() {
        assert_eq!(
            embedding_pooling(Some("last"), Some("mean")).0,
            Pooling::Last
        );
        assert_eq!(embedding_pooling(None, Some("last")).0, Pooling::Last);
        let (p, why) = embedding_pooling(None, Some("cls"));
        assert!(
            p == Pooling::Mean && why.contains("cls") && why.contains("--pooling"),
            "{why}"
        );
        assert_eq!(embedding_pooling(None, None).0, Pooling::Mean);
    }
}
