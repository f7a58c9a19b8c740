//! metrale-engine: requests in, tokens out. Owns the scheduler (continuous batching over the backend's
//! KV slots: admit waiting requests into free slots, mix prefill chunks and decode steps in one
//! `Backend::step`), per-request token-level stopping (max tokens, EOS unless ignored, cancellation) and
//! the serving metrics. It knows nothing of HTTP, JSON or text: the server turns text into token ids and
//! back, and handles stop strings.
//!
//! TODO(cpu-engine): implement. The public API below is the contract the server codes against.

use metrale_backend::sampler::SamplingParams;

/// One generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (EOS and the like). Ignored when `ignore_eos`.
    pub stop_tokens: Vec<u32>,
    pub ignore_eos: bool,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` or the slot's context capacity was reached.
    Length,
}

/// What the engine streams back for one request.
#[derive(Debug, Clone)]
pub enum Event {
    Token { id: u32, logprob: f32, top_logprobs: Vec<(u32, f32)> },
    Done { reason: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    Error(String),
}

/// Refusals at submit time (the client's mistake or a full queue): the server maps them to 4xx/503.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt has {prompt} tokens but the context holds {capacity}; shorten the prompt or raise --ctx-size")]
    PromptTooLong { prompt: usize, capacity: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the engine has stopped: {0}")]
    Stopped(String),
}
