//! Shared server state: what is known before the model is loaded (flags, the connection count, the
//! shutdown signal) and what the loaded model provides (`Served`), published once through a
//! `OnceLock` so `/health` can answer 503 until then.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// The target this binary was built for (`hw/model/quant`; `None`: a generic build).
    pub target: Option<String>,
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
    /// The syntax the model writes tool calls in (the target's `tool_call_format`).
    pub tool_format: crate::tools::ToolFormat,
    /// The structured-output grammars' factory (None: it could not be built at start-up; such
    /// requests get a 400 saying so).
    pub grammars: Option<Arc<crate::grammar::Grammars>>,
    /// Silence after which a stream sends `: keep-alive` (None: never).
    pub sse_keepalive: Option<Duration>,
    /// The per-request log line as JSON (else text).
    pub log_json: bool,
    /// `--embeddings`: how /v1/embeddings pools (`None`: off).
    pub embeddings: Option<metrale_backend::Pooling>,
    /// Length of the model's hidden state.
    pub hidden: usize,
    /// `--reasoning-format`, resolved against the chat template at start-up.
    pub reasoning: crate::reasoning::Format,
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
            grammars: self.grammars.as_deref(),
            tool_format: self.tool_format,
            embeddings: self.embeddings,
            hidden: self.hidden,
            reasoning: self.reasoning,
        }
    }
}

/// Limits that hold from start-up, before the model is ready.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests waiting (see [`Queue`]) before new ones get a 429.
    pub max_queue: usize,
    /// Time a client has to send a request's body.
    pub client_timeout: Duration,
}

/// The requests waiting: admitted past `--max-queue` and not yet running (their body being read,
/// being prepared, or queued in the engine for a slot). A request holds a [`Ticket`] from admission
/// until its first generated token (or its end), so the count covers every stage.
#[derive(Default)]
pub struct Queue {
    waiting: Arc<AtomicUsize>,
}

/// One waiting request; dropping the last clone leaves the queue.
#[derive(Clone)]
pub struct Ticket(#[allow(dead_code)] Arc<TicketInner>);

struct TicketInner(Arc<AtomicUsize>);

impl Drop for TicketInner {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Queue {
    /// A ticket, unless `max` requests already wait (checked and counted in one step, so a burst
    /// cannot pass the limit between the two).
    pub fn enter(&self, max: usize) -> Result<Ticket, usize> {
        let before = self.waiting.fetch_add(1, Ordering::SeqCst);
        if before >= max {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(before);
        }
        Ok(Ticket(Arc::new(TicketInner(self.waiting.clone()))))
    }

    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The axum state.
pub struct AppState {
    pub ready: OnceLock<Arc<Served>>,
    /// The accepted API keys (empty: none required).
    pub api_keys: Vec<String>,
    /// Origins allowed by CORS (`*`: any; empty: no CORS headers).
    pub cors_origins: Vec<String>,
    /// The chat page is served at `/` (`--no-webui` turns it off).
    pub webui: bool,
    pub limits: Limits,
    pub conns: Arc<Connections>,
    /// Turns true when the shutdown deadline has passed: open generations end with an error.
    pub abort: watch::Receiver<bool>,
    /// Requests refused before any work, by error code (`queue_full`, `memory_busy`, ...).
    pub rejected: Mutex<BTreeMap<&'static str, u64>>,
    pub queue: Queue,
}

impl AppState {
    pub fn new(
        (api_keys, cors_origins, webui): (Vec<String>, Vec<String>, bool),
        limits: Limits,
        conns: Arc<Connections>,
        abort: watch::Receiver<bool>,
    ) -> Arc<Self> {
        Arc::new(Self {
            ready: OnceLock::new(),
            api_keys,
            cors_origins,
            webui,
            limits,
            conns,
            abort,
            rejected: Mutex::new(BTreeMap::new()),
            queue: Queue::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_never_passes_its_limit_and_tickets_leave_it() {
        let q = Queue::default();
        let a = q.enter(2).unwrap();
        let b = a.clone();
        let c = q.enter(2).unwrap();
        assert_eq!(q.enter(2).err(), Some(2));
        assert_eq!(q.len(), 2);
        drop(a);
        assert_eq!(q.len(), 2, "a clone still holds the ticket");
        drop(b);
        drop(c);
        assert!(q.is_empty());
        // Many threads at once: never more than the limit admitted.
        let q = Arc::new(Queue::default());
        let admitted: Vec<_> = (0..64)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || q.enter(8).ok())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        assert_eq!(admitted.len(), 8);
    }
}
