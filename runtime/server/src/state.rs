//! Shared server state: what is known before the model is loaded (flags) and what the loaded model
//! provides (`Served`), published once through a `OnceLock` so `/health` can answer 503 until then.

use std::sync::{Arc, OnceLock};

use metrale_engine::EngineHandle;
use metrale_model::{ChatTemplate, Model};

use crate::api::SamplingPreset;

/// Everything a request needs once the model is ready.
pub struct Served {
    pub model: Arc<Model>,
    /// --chat-template override, else the model's own (None: chat is refused with a fix).
    pub chat_template: Option<ChatTemplate>,
    pub engine: EngineHandle,
    /// The name clients see in /v1/models and responses (--alias, else the model's name).
    pub name: String,
    /// Tokens one sequence can hold (prompt + generated).
    pub ctx_size: usize,
    /// Total KV capacity in tokens (slots x ctx_size).
    pub kv_tokens: usize,
    pub parallel: usize,
    pub chat_preset: SamplingPreset,
    pub completion_preset: SamplingPreset,
    /// The target's `[behavior] max_tokens` (None: fill the context).
    pub default_max_tokens: Option<usize>,
    /// Tokens that end generation (the model's EOS ids).
    pub stop_tokens: Vec<u32>,
    pub vocab: usize,
    pub created: u64,
}

/// The axum state.
pub struct AppState {
    pub ready: OnceLock<Arc<Served>>,
    pub api_key: Option<String>,
}

impl AppState {
    pub fn new(api_key: Option<String>) -> Arc<Self> {
        Arc::new(Self {
            ready: OnceLock::new(),
            api_key,
        })
    }
}
