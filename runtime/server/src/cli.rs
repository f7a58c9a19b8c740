//! The command line, in the style of llama-server and vLLM (aliases for both spellings).

use std::path::PathBuf;

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "metrale-server",
    version,
    about = "OpenAI-compatible LLM server built by metrale for one (hardware, model, quant) target",
    after_help = "Example: metrale-server --model SmolLM2-135M-Instruct.Q4_1.gguf --port 8080\n\
                  Get the default model with: cargo xtask fetch-model smollm2-135m"
)]
pub struct Cli {
    /// A .gguf file or an HF checkpoint directory (config.json + safetensors + tokenizer files).
    #[arg(short = 'm', long, env = "METRALE_MODEL", required_unless_present_any = ["attestation", "target_info"])]
    pub model: Option<PathBuf>,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,

    /// Tokens one sequence can hold, prompt + generated (default: the target's `[behavior] ctx_size`,
    /// capped by the model's context length).
    #[arg(short = 'c', long, visible_alias = "max-model-len")]
    pub ctx_size: Option<usize>,

    /// Sequences served at once (KV-cache slots; default: the target's `[behavior] parallel`, else 4).
    #[arg(long, visible_alias = "max-num-seqs", alias = "np")]
    pub parallel: Option<usize>,

    /// Tokens of the KV cache pool shared by all sequences, in blocks of 16 (default: the cpu backend
    /// holds every sequence at full context, `--parallel x --ctx-size`; the cuda backend takes that
    /// or what fits in `--gpu-memory-utilization` of the GPU's memory after the weights, whichever is
    /// less). When it runs short, the newest sequences wait (or are recomputed later).
    #[arg(long, visible_alias = "num-gpu-blocks-override-tokens")]
    pub kv_cache_tokens: Option<usize>,

    /// Fraction of the GPU's memory the cuda backend may use in all (weights, buffers, KV cache).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,

    /// The KV cache's element type (vLLM's flag): `auto` (the target's: f32 for the plain cpu
    /// build), `f32`, `bf16`, or `fp8` (`fp8_e4m3`): each head's K or V vector of a token as e4m3
    /// bytes with its own f32 scale, ~1/4 of f32's bytes (cpu backend; a kernel backend reads the
    /// type its target was built for).
    #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "bf16", "fp8", "fp8_e4m3"])]
    pub kv_cache_dtype: String,

    /// Quantize the checkpoint's layer matrices at load (vLLM's flag): `fp8` makes a bf16, f16 or
    /// f32 checkpoint's projections FP8 e4m3 with one scale per output channel, their inputs
    /// quantized per token (W8A8). FP8 checkpoints (compressed-tensors, fbgemm_fp8) need no flag.
    #[arg(short = 'q', long, value_parser = ["fp8"])]
    pub quantization: Option<String>,

    /// CPU threads for the cpu backend (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,

    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize; several keys are
    /// separated by commas (any one is accepted).
    #[arg(long, env = "METRALE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// A file of API keys, one per line (blank lines and lines starting with # are skipped); with
    /// --api-key, the keys of both are accepted.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,

    /// Origins allowed to call the API from a browser (CORS), comma-separated, or `*` for any;
    /// preflight requests are answered. Default: none (no CORS headers).
    #[arg(long, value_delimiter = ',')]
    pub cors_origins: Vec<String>,

    /// Serve POST /v1/embeddings: each input's final-normed hidden states pooled (--pooling) and
    /// scaled to unit length.
    #[arg(long)]
    pub embeddings: bool,

    /// How /v1/embeddings pools a prompt's hidden states: `mean` (over its tokens) or `last` (the
    /// last token's). Default: what the GGUF's `<arch>.pooling_type` says where it is one of those,
    /// else `mean`.
    #[arg(long, value_parser = ["mean", "last"])]
    pub pooling: Option<String>,

    /// How a thinking model's `<think>...</think>` comes back from the chat endpoint: `deepseek`
    /// (as `reasoning_content`, apart from `content`), `none` (in the text as written), `harmony`
    /// (gpt-oss's channels: the analysis channel as `reasoning_content`, the final one as
    /// `content`, messages to `functions.*` as tool calls), or `auto` (`harmony` when the chat
    /// template writes `<|channel|>`, `deepseek` when it writes `<think>`).
    #[arg(long, default_value = "auto", value_parser = ["none", "deepseek", "harmony", "auto"])]
    pub reasoning_format: String,

    /// Do not serve the chat page at `/` (the API is served either way).
    #[arg(long)]
    pub no_webui: bool,

    /// Seconds of silence after which a stream sends an SSE comment (`: keep-alive`), so that
    /// proxies and clients do not time out during a long prefill or queue wait (0: never).
    #[arg(long, default_value_t = 10)]
    pub sse_keepalive: u64,

    /// The per-request log line on stderr: text, or one JSON object per line.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// The model name clients see (default: the model's own name).
    #[arg(short = 'a', long, visible_alias = "served-model-name")]
    pub alias: Option<String>,

    /// A Jinja chat template file that replaces the model's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,

    /// Do not reuse a finished sequence's KV entries for a new prompt that starts with the same
    /// tokens (prefix caching is on by default; /metrics counts its hits).
    #[arg(long, alias = "no-enable-prefix-caching")]
    pub no_prefix_caching: bool,

    /// Most tokens one engine step carries (vLLM's flag): every running decode's token (and its
    /// speculative proposals) first, then prompt chunks up to the budget, so a long prompt is
    /// prefilled in pieces between decode steps instead of stalling them. A prompt may take the
    /// whole budget of a step (see --long-prefill-token-threshold).
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,

    /// Most prompt tokens one request prefills in a step (vLLM's flag); 0 (the default): the
    /// backend's measured choice (the CPU backend 256; CUDA as many as the step's budget leaves,
    /// since each step reads every weight once). A lower cap shares each step's budget among
    /// several prompts arriving together, at the cost of more steps for a prompt alone.
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,

    /// Speculative decoding: `ngram` proposes the tokens that followed the latest earlier
    /// occurrence of the sequence's last few tokens (prompt lookup) and verifies them in the decode
    /// step; output is unchanged (greedy token for token, sampled in distribution). Requests under
    /// a grammar decode plainly.
    /// `draft` proposes with a smaller model of the same tokenizer (--draft-model), greedily, on
    /// its own KV cache.
    #[arg(long, value_parser = ["ngram", "draft"])]
    pub speculative: Option<String>,

    /// The draft model of --speculative draft (GGUF or HF folder, same tokenizer as --model).
    #[arg(long, visible_alias = "model-draft")]
    pub draft_model: Option<PathBuf>,

    /// Most tokens proposed for one sequence in one step (with --speculative).
    #[arg(long, default_value_t = 4)]
    pub num_speculative_tokens: usize,

    /// Prompt lookup: the shortest run of last tokens looked up (with --speculative ngram).
    #[arg(long, default_value_t = 2)]
    pub prompt_lookup_min: usize,

    /// Prompt lookup: the longest run of last tokens looked up (with --speculative ngram).
    #[arg(long, default_value_t = 4)]
    pub prompt_lookup_max: usize,

    /// Requests that may wait (being prepared, or queued for a sequence slot) before new ones are
    /// answered 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,

    /// Open connections before new ones are answered 503 (default 4096, or what the open-file
    /// limit allows).
    #[arg(long)]
    pub max_connections: Option<usize>,

    /// Seconds a client has to send a request's headers (counted from connecting or from its
    /// previous response, so idle keep-alive connections close after it too), to send its body,
    /// and for any stalled response write to make progress.
    #[arg(long, visible_alias = "timeout", default_value_t = 30)]
    pub client_timeout: u64,

    /// On SIGTERM or Ctrl-C: seconds in-flight requests get to finish before they are ended with
    /// an error (the exit code is 0 only if all finished).
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,

    /// Memory the server may use in all, e.g. 16G (default: the cgroup's limit, else the
    /// address-space limit, else the host's available memory). Requests whose worst case does not
    /// fit what is left after the model are refused.
    #[arg(long, value_parser = crate::budget::parse_size)]
    pub max_memory: Option<u64>,

    /// Print the embedded attestation (in-toto statement, JSON) and exit.
    #[arg(long)]
    pub attestation: bool,

    /// Print what this binary was built for (target, shapes served, presets) and exit.
    #[arg(long)]
    pub target_info: bool,
}

/// Validate flag values that clap cannot (fail before loading anything).
pub fn check(cli: &Cli) -> anyhow::Result<()> {
    if cli.ctx_size == Some(0) {
        anyhow::bail!("--ctx-size must be at least 2 tokens (got 0)");
    }
    if !(cli.gpu_memory_utilization > 0.0 && cli.gpu_memory_utilization <= 1.0) {
        anyhow::bail!(
            "--gpu-memory-utilization must be in (0, 1] (got {})",
            cli.gpu_memory_utilization
        );
    }
    if cli.max_num_batched_tokens == 0 {
        anyhow::bail!("--max-num-batched-tokens must be at least 1 (got 0)");
    }
    if cli.speculative.is_some() && cli.num_speculative_tokens == 0 {
        anyhow::bail!("--num-speculative-tokens must be at least 1 with --speculative (got 0)");
    }
    match (cli.speculative.as_deref(), &cli.draft_model) {
        (Some("draft"), None) => {
            anyhow::bail!("--speculative draft needs --draft-model PATH (a smaller model of the same tokenizer)")
        }
        (s, Some(_)) if s != Some("draft") => {
            anyhow::bail!(
                "--draft-model is used with --speculative draft; add it, or drop --draft-model"
            )
        }
        _ => {}
    }
    if cli.prompt_lookup_min == 0 || cli.prompt_lookup_min > cli.prompt_lookup_max {
        anyhow::bail!(
            "--prompt-lookup-min ({}) must be at least 1 and at most --prompt-lookup-max ({})",
            cli.prompt_lookup_min,
            cli.prompt_lookup_max
        );
    }
    if cli.kv_cache_tokens == Some(0) {
        anyhow::bail!("--kv-cache-tokens must be at least one sequence's context (got 0)");
    }
    if cli.parallel == Some(0) {
        anyhow::bail!("--parallel must be at least 1 (got 0)");
    }
    if cli.threads == Some(0) {
        anyhow::bail!("--threads must be at least 1 (got 0); leave it out to use every core");
    }
    if cli.max_queue == 0 {
        anyhow::bail!("--max-queue must be at least 1 (got 0)");
    }
    if cli.max_connections == Some(0) {
        anyhow::bail!("--max-connections must be at least 1 (got 0)");
    }
    if cli.client_timeout == 0 {
        anyhow::bail!("--client-timeout must be at least 1 second (got 0)");
    }
    if cli
        .api_key
        .as_deref()
        .is_some_and(|k| k.split(',').any(|k| k.trim().is_empty()))
    {
        anyhow::bail!(
            "--api-key has an empty key; give non-empty keys separated by commas, or leave the flag out"
        );
    }
    if let Some(m) = &cli.model {
        if !m.exists() {
            anyhow::bail!(
                "model not found: {} (give a .gguf file or an HF checkpoint directory; the default model \
                 comes from `cargo xtask fetch-model smollm2-135m`, which prints its path)",
                m.display()
            );
        }
    }
    if let Some(t) = &cli.chat_template {
        if !t.exists() {
            anyhow::bail!("--chat-template: no such file {}", t.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_parse() {
        let c = Cli::try_parse_from([
            "metrale-server",
            "--model",
            "/",
            "--max-num-seqs",
            "3",
            "--served-model-name",
            "x",
            "--max-model-len",
            "512",
        ])
        .unwrap();
        assert_eq!(c.parallel, Some(3));
        assert_eq!(c.alias.as_deref(), Some("x"));
        assert_eq!(c.ctx_size, Some(512));
        assert!(check(&c).is_ok());
    }

    #[test]
    fn attestation_needs_no_model() {
        assert!(Cli::try_parse_from(["metrale-server", "--attestation"]).is_ok());
    }

    #[test]
    fn bad_values_fail_early_with_a_fix() {
        let c = Cli::try_parse_from(["metrale-server", "--model", "/nonexistent.gguf"]).unwrap();
        let e = check(&c).unwrap_err().to_string();
        assert!(e.contains("fetch-model"), "{e}");
        let c = Cli::try_parse_from(["metrale-server", "--model", "/", "--parallel", "0"]).unwrap();
        assert!(check(&c).is_err());
        assert!(
            Cli::try_parse_from(["metrale-server", "--model", "/", "--port", "99999"]).is_err()
        );
    }
}

/// How the per-request log line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Every API key the server accepts: `--api-key` (comma-separated) and `--api-key-file` (one per
/// line; blank lines and `#` comments skipped). An empty list means no key is required; a key file
/// that holds no key is an error (it would silently open the server).
pub fn api_keys(cli: &Cli) -> anyhow::Result<Vec<String>> {
    let mut keys: Vec<String> = cli
        .api_key
        .iter()
        .flat_map(|k| k.split(','))
        .map(|k| k.trim().to_string())
        .collect();
    if let Some(p) = &cli.api_key_file {
        let text = metrale_model::files::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("reading --api-key-file {}: {e}", p.display()))?;
        let before = keys.len();
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
        if keys.len() == before {
            anyhow::bail!(
                "--api-key-file {} holds no key (one per line); add keys or leave the flag out",
                p.display()
            );
        }
    }
    Ok(keys)
}
