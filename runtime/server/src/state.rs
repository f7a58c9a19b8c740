//! Shared server state: what is known before the model is loaded (flags, the connection count, the
//! shutdown signal) and what the loaded model provides (`Served`), published once through a
//! `OnceLock` so `/health` can answer 503 until then.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use metrale_engine::EngineHandle;
use metrale_model::{ChatTemplate, Model};
use tokio::sync::watch;

use crate::api::SamplingPreset;
use crate::budget::MemoryBudget;
use crate::listen::Connections;
use crate::pool::Pool;
use crate::prepare::Prep;

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
    /// Threads for parsing, rendering and tokenizing requests.
    pub pool: Pool,
    /// What requests may reserve of the process's memory.
    pub budget: Arc<MemoryBudget>,
}

impl Served {
    /// What preparing a request needs.
    pub fn prep(&self) -> Prep<'_> {
        Prep {
            tokenizer: &self.model.tokenizer,
            template: self.chat_template.as_ref(),
            chat_preset: &self.chat_preset,
            completion_preset: &self.completion_preset,
            vocab: self.vocab,
            ctx_size: self.ctx_size,
        }
    }

    /// Requests waiting: being prepared, or queued for a slot.
    pub fn queue_depth(&self) -> usize {
        self.pool.pending() + self.engine.waiting()
    }
}

/// Limits that hold from start-up, before the model is ready.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests waiting (see [`Served::queue_depth`]) before new ones get a 429.
    pub max_queue: usize,
    /// Time a client has to send a request's body.
    pub client_timeout: Duration,
}

/// The axum state.
pub struct AppState {
    pub ready: OnceLock<Arc<Served>>,
    pub api_key: Option<String>,
    pub limits: Limits,
    pub conns: Arc<Connections>,
    /// Turns true when the shutdown deadline has passed: open generations end with an error.
    pub abort: watch::Receiver<bool>,
    /// Requests refused before any work, by error code (`queue_full`, `memory_busy`, ...).
    pub rejected: Mutex<BTreeMap<&'static str, u64>>,
}

impl AppState {
    pub fn new(
        api_key: Option<String>,
        limits: Limits,
        conns: Arc<Connections>,
        abort: watch::Receiver<bool>,
    ) -> Arc<Self> {
        Arc::new(Self {
            ready: OnceLock::new(),
            api_key,
            limits,
            conns,
            abort,
            rejected: Mutex::new(BTreeMap::new()),
        })
    }
}
