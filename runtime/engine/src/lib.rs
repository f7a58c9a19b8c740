//! metrale-engine: requests in, tokens out. Owns the scheduler (continuous batching over the backend's
//! slots and KV blocks: admit waiting requests into free slots, mix prefill chunks and decode steps in one
//! `Backend::step`), per-request token-level stopping (max tokens, EOS unless ignored, cancellation) and
//! the serving metrics. It knows nothing of HTTP, JSON or text: the server turns text into token ids and
//! back, and handles stop strings.
//!
//! Architecture: [`Engine::spawn`] moves the backend onto a dedicated OS thread running the loop;
//! [`EngineHandle`] (cheap to clone, Send + Sync) submits requests over a channel and reads metrics.
//! Each loop iteration: take new requests, drop the cancelled ones (their event receiver is gone),
//! admit waiting requests (FIFO) into free slots, then build one step: one token for every decoding
//! sequence, then prefill chunks (at most `prefill_chunk` tokens each, at most `max_step_tokens` in
//! all, but always at least one chunk so prefill progresses), run it, stream the sampled tokens.
//! With speculative decoding ([`spec`]) a decode entry carries the proposals for its sequence
//! after its last token (`SeqStep::drafted`, within the step's token budget and the free blocks);
//! the accepted ones and the sample after them stream as that many tokens, and the history rolls
//! back to them.
//! When nothing runs or waits, the loop blocks on the channel; when every handle is dropped, it ends.
//!
//! KV blocks ([`blocks`]): the backend's KV cache is one pool of blocks of `KV_BLOCK` tokens; a
//! running sequence holds a block table covering its positions. A request is admitted when a slot is
//! free and the pool can give its whole prompt's blocks (FIFO: the oldest waits first); a decode that
//! needs a new block when none is left preempts the most recently admitted sequence (its blocks go
//! back to the pool, it goes back to the front of the queue with everything generated so far and is
//! recomputed when blocks free up, as vLLM's recompute preemption does). Nothing is refused for want
//! of blocks and nothing runs out of memory: the pool holds at least one sequence of full context.
//!
//! Prefix caching (`EngineConfig::prefix_caching`, on by default, as in vLLM and llama-server): every
//! full block is registered under its tokens and its predecessors' (`blocks::BlockKey`); a new
//! request takes the registered blocks that hold its prompt's leading full blocks and starts its
//! prefill after them (always recomputing at least the prompt's last token, whose logits it needs).
//! Released blocks stay registered until the pool needs them (least recently released first). The KV
//! entries of a position depend only on the tokens up to it, so the answer is the same as without the
//! cache up to the numerics of the path that computed them (prefill or decode).
//! A step the backend refuses is re-run entry by entry so that only the offending request gets an
//! `Error`; a backend panic ends every request and the engine (submit then answers `Stopped`).
//!
//! Embedding requests (`GenerateRequest::embed`) run their prompt's chunks like any prompt, through
//! `Backend::hidden` in the same iteration as the step (no prefix-cache hits: every token's hidden
//! state is pooled); the last chunk sends `Event::Embedding` and `Done` with no completion tokens.
//!
//! Invariants: a running request owns exactly one slot, released exactly once per admission; it holds
//! each block of its table once, released when it ends or is preempted; it writes only blocks no
//! other sequence holds; `start_pos` given to the backend is always the number of its tokens already
//! in its blocks; a request that ends sends exactly one `Done` or `Error` (unless its receiver is gone);
//! stop tokens are not streamed as `Token` events but count in `completion_tokens`; generation never
//! needs more positions than the slot holds (`max_tokens` is clipped at submit time).

pub mod blocks;
pub mod metrics;
pub mod spec;

pub use metrale_backend::BackendInfo;
pub use metrics::{Histogram, MetricsSnapshot};
pub use spec::{Proposer, Speculation};

use blocks::{BlockKey, BlockPool};
use metrale_backend::{blocks_for, Backend, HiddenSums, Pooling, SeqOutput, SeqStep, KV_BLOCK};
use metrale_core::BackendError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc as tmpsc;

use metrale_backend::sampler::SamplingParams;

/// A constraint on the tokens a sequence may generate (a grammar): before each sampled token the
/// engine asks for the allowed set, and tells it the token sampled. Built by the caller (which knows
/// the tokenizer); the engine stays token-level.
pub trait TokenConstraint: Send {
    /// The tokens the next one may be, as a bitmask (bit `t % 32` of word `t / 32`).
    fn allowed(&mut self) -> Result<Vec<u32>, String>;
    /// The token sampled (one the last mask allowed).
    fn commit(&mut self, token: u32) -> Result<(), String>;
    /// Whether the constraint is complete: nothing more may follow (the sequence ends with `Stop`).
    fn finished(&self) -> bool;
}

/// A request's constraint (a box, so a request stays one value).
pub struct Constraint(pub Box<dyn TokenConstraint>);

/// A step's grammars, taken out of their sequences while the backend runs the step, and the masks
/// (or errors) computed from them, by plan entry.
struct StepMasks {
    constraints: Vec<Option<Constraint>>,
    done: Vec<Option<Result<Vec<u32>, String>>>,
    /// Masks computed, and the host time they took (the metrics' grammar mask counters).
    count: u64,
    seconds: f64,
}

/// A step's masks are computed one after another, as the backend asks. Measured
/// (`runtime/server/examples/mask_bench.rs`, `bench/structured/`, 2-core machine): a nested JSON
/// schema's mask takes 3-4 us at the median, ~20-27 us on average and ~0.5 ms at the 99th
/// percentile, on 49k and 128k vocabularies alike; 64 streams' masks ~0.9 ms a step (median). On
/// two threads they were slower (64 streams 1.2-1.3 ms); hiding them behind the device's forward
/// pass ([`metrale_backend::Backend::step_masked`]) is what makes them free.
impl metrale_backend::MaskSource for StepMasks {
    fn mask(&mut self, k: usize) -> Option<Vec<u32>> {
        if self.done[k].is_none() {
            let c = self.constraints[k].as_mut()?;
            let t = Instant::now();
            self.done[k] = Some(c.0.allowed());
            self.seconds += t.elapsed().as_secs_f64();
            self.count += 1;
        }
        self.done[k].as_ref().and_then(|r| r.as_ref().ok()).cloned()
    }
}

/// A one-entry retry of a step asks for plan entry `.1`'s mask as entry 0.
struct Retry<'g>(&'g mut StepMasks, Option<usize>);

impl metrale_backend::MaskSource for Retry<'_> {
    fn mask(&mut self, i: usize) -> Option<Vec<u32>> {
        self.0.mask(self.1.unwrap_or(i))
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// One generation request, already tokenized.
#[derive(Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (EOS and the like). Ignored when `ignore_eos`.
    pub stop_tokens: Vec<u32>,
    pub ignore_eos: bool,
    /// What the engine and the caller share while the request runs (`RequestLink`).
    pub link: Arc<RequestLink>,
    /// The grammar every generated token must follow (`None`: any token).
    pub constraint: Option<Constraint>,
    /// Pool the prompt's hidden states into one embedding (`Event::Embedding`) instead of
    /// generating; `max_tokens`, `sampling` and `constraint` are then unused.
    pub embed: Option<Pooling>,
}

/// What the engine and the caller share about one running request, besides its events: the
/// prompt tokens the prefix cache served (set at admission, readable before `Done`), and whether
/// the caller ended it on a stop string (then the dropped receiver counts as a `stop`, not an
/// abort, in the metrics).
#[derive(Debug, Default)]
pub struct RequestLink {
    cached_tokens: AtomicUsize,
    stop_string: std::sync::atomic::AtomicBool,
}

impl RequestLink {
    /// Prompt tokens whose KV entries came from the prefix cache (0 until admitted).
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens.load(Ordering::Relaxed)
    }

    /// Say that the caller ended the request on a stop string; then drop its receiver.
    pub fn end_on_stop_string(&self) {
        self.stop_string.store(true, Ordering::Release);
    }
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
    Token {
        id: u32,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    },
    /// The prompt's embedding (unit length), before its `Done`.
    Embedding(Vec<f32>),
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens whose KV entries came from the prefix cache (not computed again).
        cached_tokens: usize,
    },
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

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most prompt tokens of one sequence per step (vLLM's `long_prefill_token_threshold`); the
    /// default is the whole step budget, so a prompt alone is prefilled in as few steps as the
    /// budget allows (each step reads every weight once: on a GPU two 256-token steps of an 8B
    /// model cost most of a second weight read more than one 512-token step).
    pub prefill_chunk: usize,
    /// Most tokens (decode + prefill) per step, unless one decode token per running sequence needs more.
    pub max_step_tokens: usize,
    /// Reuse registered KV blocks for a prompt that starts with the tokens they hold (module docs).
    pub prefix_caching: bool,
    /// Speculative decoding ([`spec`]): proposals verified in the decode steps of sequences with
    /// no grammar, when the backend verifies (`BackendInfo::verifies_drafts`); `None`: off.
    pub speculation: Option<Speculation>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            prefill_chunk: 512,
            max_step_tokens: 512,
            prefix_caching: true,
            speculation: None,
        }
    }
}

/// The engine (see the module docs); [`Engine::spawn`] starts it.
pub struct Engine;

struct Submitted {
    req: GenerateRequest,
    tx: tmpsc::UnboundedSender<Event>,
    at: Instant,
}

struct Shared {
    tx: Mutex<Option<mpsc::Sender<Submitted>>>,
    info: BackendInfo,
    metrics: Mutex<MetricsSnapshot>,
    /// Submitted but not yet admitted into a slot.
    waiting: AtomicUsize,
    dead: Mutex<Option<String>>,
}

/// A handle on a running engine: submit requests, read metrics and backend info.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl Engine {
    /// Start the engine loop on its own thread, owning `backend`.
    pub fn spawn(backend: Box<dyn Backend>, cfg: EngineConfig) -> EngineHandle {
        Engine::spawn_with_draft(backend, None, cfg)
    }

    /// [`Engine::spawn`] with the draft model of `Proposer::Draft`: a backend of the same
    /// vocabulary with at least the target's slots and context, its KV pool laid out
    /// [`metrale_backend::KvConfig::per_slot`]. Without it (or a backend that does not verify),
    /// a draft configuration decodes plainly.
    pub fn spawn_with_draft(
        backend: Box<dyn Backend>,
        draft: Option<Box<dyn Backend>>,
        cfg: EngineConfig,
    ) -> EngineHandle {
        let info = backend.info();
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            tx: Mutex::new(Some(tx)),
            info,
            metrics: Mutex::new(MetricsSnapshot::default()),
            waiting: AtomicUsize::new(0),
            dead: Mutex::new(None),
        });
        // The loop holds the shared state weakly only, so that dropping the last handle drops the
        // sender and ends the loop.
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("metrale-engine".into())
            .spawn(move || Loop::new(backend, draft, cfg, rx, weak).run())
            .expect("spawning the engine thread");
        EngineHandle { shared }
    }
}

impl EngineHandle {
    /// Queue a request. Events arrive on the returned receiver; dropping it cancels the request.
    /// `max_tokens` is clipped so that the prompt and the generated tokens fit one slot.
    pub fn submit(
        &self,
        mut req: GenerateRequest,
    ) -> Result<tmpsc::UnboundedReceiver<Event>, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let capacity = self.shared.info.slot_capacity;
        if req.prompt.len() > capacity {
            return Err(SubmitError::PromptTooLong {
                prompt: req.prompt.len(),
                capacity,
            });
        }
        // The prompt fills positions 0..p; generated token k (k >= 1) is fed at position p + k - 1.
        req.max_tokens = req.max_tokens.min(capacity + 1 - req.prompt.len());
        if let Some(why) = self.shared.dead.lock().unwrap().clone() {
            return Err(SubmitError::Stopped(why));
        }
        let (tx, rx) = tmpsc::unbounded_channel();
        let guard = self.shared.tx.lock().unwrap();
        let sender = guard
            .as_ref()
            .ok_or_else(|| SubmitError::Stopped("the engine was shut down".into()))?;
        self.shared.waiting.fetch_add(1, Ordering::SeqCst);
        if sender
            .send(Submitted {
                req,
                tx,
                at: Instant::now(),
            })
            .is_err()
        {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            let why = self
                .shared
                .dead
                .lock()
                .unwrap()
                .clone()
                .unwrap_or_else(|| "the engine thread has ended".into());
            return Err(SubmitError::Stopped(why));
        }
        Ok(rx)
    }

    /// The current metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = self.shared.metrics.lock().unwrap().clone();
        m.num_requests_waiting = self.shared.waiting.load(Ordering::SeqCst);
        m
    }

    /// Sequences submitted and not yet admitted into a slot.
    pub fn waiting(&self) -> usize {
        self.shared.waiting.load(Ordering::SeqCst)
    }

    /// What the backend reported when the engine started.
    pub fn info(&self) -> BackendInfo {
        self.shared.info.clone()
    }

    /// Why the engine stopped, if it did (a backend panic); `None` while it runs.
    pub fn failure(&self) -> Option<String> {
        self.shared.dead.lock().unwrap().clone()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Dropping the sender wakes the loop, which then ends.
        self.tx.get_mut().unwrap().take();
    }
}

struct Seq {
    req: GenerateRequest,
    tx: tmpsc::UnboundedSender<Event>,
    slot: usize,
    /// prompt + generated (the last generated token is fed at the next decode).
    history: Vec<u32>,
    /// Tokens of `history` already in the KV cache (in `blocks`).
    cached: usize,
    /// The history length prefilled before sampling: the prompt, or after a preemption everything
    /// up to the last generated token.
    prefill_end: usize,
    /// The block table: position p is in `blocks[p / KV_BLOCK]`.
    blocks: Vec<u32>,
    /// Key ids of the leading full blocks registered (or found) in the prefix cache.
    keys: Vec<u64>,
    /// Prompt tokens taken from the prefix cache at (first) admission.
    reused: usize,
    generated: usize,
    submitted: Instant,
    last_token_at: Option<Instant>,
    /// Admission order (preemption takes the latest).
    order: u64,
    /// An embedding request's hidden states pooled over the chunks computed so far.
    hidden: HiddenSums,
    /// Proposed tokens at the end of `history` during a step (verified by it; 0 otherwise).
    drafted: usize,
    /// Tokens of `history` in the draft model's KV cache (`Proposer::Draft`), in its slot's run of
    /// blocks (`slot_blocks`).
    draft_cached: usize,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.cached < self.prefill_end
    }
}

/// A request waiting for a slot: new; new and already tried but short of blocks; or preempted
/// (its state kept, its blocks given back).
enum Waiting {
    New(Submitted),
    Blocked(Seq),
    Preempted(Seq),
}

impl Waiting {
    fn closed(&self) -> bool {
        match self {
            Waiting::New(s) => s.tx.is_closed(),
            Waiting::Blocked(s) | Waiting::Preempted(s) => s.tx.is_closed(),
        }
    }
}

struct Loop {
    backend: Box<dyn Backend>,
    cfg: EngineConfig,
    rx: mpsc::Receiver<Submitted>,
    shared: std::sync::Weak<Shared>,
    waiting: VecDeque<Waiting>,
    running: Vec<Seq>,
    free: Vec<usize>,
    pool: BlockPool,
    admissions: u64,
    capacity: usize,
    m: MetricsSnapshot,
    /// Events of this iteration, sent after the metrics are published (so a client that has seen
    /// `Done` reads metrics that count its request).
    outbox: Vec<(tmpsc::UnboundedSender<Event>, Event)>,
    /// The draft model of `Proposer::Draft`.
    draft: Option<Draft>,
}

/// A draft model: a second backend with as many slots as the target's, each sequence in its
/// slot's own run of blocks (`KvConfig::per_slot`).
struct Draft {
    backend: Box<dyn Backend>,
}

enum End {
    Stop,
    Length,
    Abort,
    Error(String),
}

impl Loop {
    fn new(
        backend: Box<dyn Backend>,
        draft: Option<Box<dyn Backend>>,
        cfg: EngineConfig,
        rx: mpsc::Receiver<Submitted>,
        shared: std::sync::Weak<Shared>,
    ) -> Loop {
        let info = backend.info();
        Loop {
            backend,
            cfg: EngineConfig {
                prefill_chunk: cfg.prefill_chunk.max(1),
                max_step_tokens: cfg.max_step_tokens.max(1),
                speculation: cfg.speculation.filter(|sp| {
                    info.verifies_drafts
                        && sp.tokens > 0
                        && (sp.proposer != Proposer::Draft || draft.is_some())
                }),
                ..cfg
            },
            rx,
            shared,
            waiting: VecDeque::new(),
            running: Vec::new(),
            free: (0..info.slots).rev().collect(),
            pool: BlockPool::new(info.kv_blocks),
            admissions: 0,
            capacity: info.slot_capacity,
            m: MetricsSnapshot::default(),
            outbox: Vec::new(),
            draft: draft.map(|backend| Draft { backend }),
        }
    }

    fn flush(&mut self) {
        for (tx, ev) in self.outbox.drain(..) {
            let _ = tx.send(ev); // a closed receiver is noticed (cancelled) on the next iteration
        }
    }

    fn publish(&mut self) {
        self.m.num_requests_running = self.running.len();
        self.m.kv_cache_usage_perc = self.pool.held() as f64 / self.pool.total().max(1) as f64;
        if let Some(sh) = self.shared.upgrade() {
            *sh.metrics.lock().unwrap() = self.m.clone();
        }
    }

    fn admitted(&self, n: usize) {
        if let Some(sh) = self.shared.upgrade() {
            sh.waiting.fetch_sub(n, Ordering::SeqCst);
        }
    }

    fn run(mut self) {
        loop {
            // Intake: block only when idle.
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv() {
                    Ok(s) => self.waiting.push_back(Waiting::New(s)),
                    Err(_) => return, // every handle is gone
                }
            }
            let round = Instant::now();
            while let Ok(s) = self.rx.try_recv() {
                self.waiting.push_back(Waiting::New(s));
            }
            // Cancelled while waiting.
            let mut i = 0;
            while i < self.waiting.len() {
                if !self.waiting[i].closed() {
                    i += 1;
                    continue;
                }
                if let Some(Waiting::New(_) | Waiting::Blocked(_)) = self.waiting.remove(i) {
                    self.admitted(1);
                }
                self.m.request_success_total[2].1 += 1;
            }
            self.admit();
            // Cancelled while running.
            let mut i = 0;
            while i < self.running.len() {
                if self.running[i].tx.is_closed() {
                    self.finish(i, End::Abort);
                } else {
                    i += 1;
                }
            }
            if !self.running.is_empty() {
                self.step();
                self.m.engine_steps_total += 1;
                self.m.engine_step_seconds_total += round.elapsed().as_secs_f64();
            }
            self.publish();
            self.flush();
        }
    }

    /// Admit waiting requests, oldest first, while a slot is free and the pool can give the blocks
    /// of the tokens each must prefill (prefix-cache hits taken first).
    fn admit(&mut self) {
        while !self.free.is_empty() {
            let (mut seq, fresh) = match self.waiting.pop_front() {
                None => return,
                Some(Waiting::New(s)) if s.req.max_tokens == 0 && s.req.embed.is_none() => {
                    self.admitted(1);
                    let ev = Event::Done {
                        reason: FinishReason::Length,
                        prompt_tokens: s.req.prompt.len(),
                        completion_tokens: 0,
                        cached_tokens: 0,
                    };
                    self.outbox.push((s.tx, ev));
                    self.m.request_success_total[1].1 += 1;
                    continue;
                }
                Some(Waiting::New(s)) => {
                    let history = s.req.prompt.clone();
                    let seq = Seq {
                        prefill_end: history.len(),
                        history,
                        req: s.req,
                        tx: s.tx,
                        slot: usize::MAX,
                        cached: 0,
                        blocks: Vec::new(),
                        keys: Vec::new(),
                        reused: 0,
                        generated: 0,
                        submitted: s.at,
                        last_token_at: None,
                        order: 0,
                        hidden: HiddenSums::default(),
                        drafted: 0,
                        draft_cached: 0,
                    };
                    (seq, true)
                }
                Some(Waiting::Blocked(s)) => (s, true),
                Some(Waiting::Preempted(s)) => (s, false),
            };
            // the prefix cache: whole registered blocks, leaving at least the last token to compute
            let end = seq.prefill_end;
            // (an embedding pools every token's hidden state: no cached blocks)
            let (found, keys) = if self.cfg.prefix_caching && seq.req.embed.is_none() {
                self.pool.lookup(&seq.history[..end], (end - 1) / KV_BLOCK)
            } else {
                (Vec::new(), Vec::new())
            };
            let need = blocks_for(end) - found.len();
            if self.pool.available() < need {
                for b in found {
                    self.pool.release(b);
                }
                self.waiting.push_front(if fresh {
                    Waiting::Blocked(seq)
                } else {
                    Waiting::Preempted(seq)
                });
                return;
            }
            seq.cached = found.len() * KV_BLOCK;
            seq.blocks = found;
            seq.keys = keys;
            for _ in 0..need {
                let b = self.pool.alloc().expect("checked available");
                seq.blocks.push(b);
            }
            if fresh {
                seq.reused = seq.cached;
                seq.req
                    .link
                    .cached_tokens
                    .store(seq.cached, Ordering::Relaxed);
                self.admitted(1);
                self.m.prompt_tokens_total += seq.cached as u64;
                self.m.prefix_cache_queries_total += end as u64;
                self.m.prefix_cache_hits_total += seq.cached as u64;
            }
            seq.slot = self.free.pop().expect("checked free");
            self.admissions += 1;
            seq.order = self.admissions;
            self.running.push(seq);
        }
    }

    /// Give the running sequence admitted as `order` blocks for one more position (and one more
    /// for a backend that runs a decode step ahead), preempting the most recently admitted
    /// sequences while the pool is empty (possibly that sequence itself).
    fn grow(&mut self, order: u64) {
        loop {
            let Some(at) = self.running.iter().position(|s| s.order == order) else {
                return; // preempted
            };
            let s = &self.running[at];
            if s.blocks.len() >= blocks_for((s.cached + 2).min(self.capacity)) {
                return;
            }
            if let Some(b) = self.pool.alloc() {
                self.running[at].blocks.push(b);
                continue;
            }
            let victim = self
                .running
                .iter()
                .enumerate()
                .max_by_key(|(_, s)| s.order)
                .map(|(v, _)| v)
                .expect("at least the sequence that grows");
            self.preempt(victim);
        }
    }

    /// Preempt running sequence `v`: its blocks back to the pool, its slot freed, itself to the
    /// front of the queue to be recomputed from its history.
    fn preempt(&mut self, v: usize) {
        let mut s = self.running.swap_remove(v);
        for &b in &s.blocks {
            self.pool.release(b);
        }
        s.blocks.clear();
        s.keys.clear();
        s.cached = 0;
        s.draft_cached = 0;
        // an embedding pools its tokens again; recompute everything but the last generated
        // token, which the next decode feeds
        s.hidden = HiddenSums::default();
        s.prefill_end = s.history.len();
        self.backend.release(s.slot);
        if let Some(d) = &mut self.draft {
            d.backend.release(s.slot);
        }
        self.free.push(s.slot);
        self.m.num_preemptions_total += 1;
        self.waiting.push_front(Waiting::Preempted(s));
    }

    /// Register the full blocks a step completed (prefix caching).
    fn register_full_blocks(&mut self, i: usize) {
        if !self.cfg.prefix_caching {
            return;
        }
        let s = &mut self.running[i];
        // (a sequence that ended on an accepted stop token has it cached but not in its history)
        while s.keys.len() < s.cached.min(s.history.len()) / KV_BLOCK {
            let k = s.keys.len();
            let parent = if k == 0 { 0 } else { s.keys[k - 1] };
            let key = BlockKey::new(parent, &s.history[k * KV_BLOCK..(k + 1) * KV_BLOCK]);
            s.keys.push(key.id());
            self.pool.register(s.blocks[k], key);
        }
    }

    /// Build and run one backend step, then stream its tokens.
    fn step(&mut self) {
        // blocks for this step's decodes, oldest first (a short pool preempts the newest)
        let mut decoding: Vec<u64> = self
            .running
            .iter()
            .filter(|s| !s.prefilling())
            .map(|s| s.order)
            .collect();
        decoding.sort_unstable();
        for order in decoding {
            self.grow(order);
        }
        if self.running.is_empty() {
            return;
        }
        // (running index, tokens range in history) per batch entry: decodes first (each with the
        // tokens proposed for it, appended to its history for the step), then prefill chunks.
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        let decoding: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].prefilling())
            .collect();
        let mut budget = self.cfg.max_step_tokens.saturating_sub(decoding.len());
        let proposals = self.proposals(&decoding, budget);
        for (&i, proposed) in decoding.iter().zip(proposals) {
            let drafted = self.take_proposals(i, &proposed);
            budget -= drafted;
            let s = &self.running[i];
            plan.push((i, s.cached, s.cached + 1 + drafted));
        }
        let mut any_prefill = false;
        for (i, s) in self.running.iter().enumerate() {
            if s.prefilling() {
                let left = s.prefill_end - s.cached;
                let n = left.min(self.cfg.prefill_chunk).min(budget);
                let n = if n == 0 && !any_prefill && plan.is_empty() {
                    left.min(self.cfg.prefill_chunk)
                } else {
                    n
                };
                if n == 0 {
                    continue;
                }
                plan.push((i, s.cached, s.cached + n));
                budget -= n.min(budget);
                any_prefill = true;
            }
        }
        // embedding requests' chunks go to `Backend::hidden`, the rest to the step
        let (eplan, plan): (Vec<_>, Vec<_>) = plan
            .into_iter()
            .partition(|&(i, _, _)| self.running[i].req.embed.is_some());
        let mut ended: Vec<(usize, End)> = Vec::new();
        if !eplan.is_empty() {
            if let Err(msg) = self.run_hidden(&eplan, &mut ended) {
                return self.die(msg);
            }
        }
        if plan.is_empty() {
            return self.end_all(ended);
        }
        // the grammars of the entries whose sample is a generated token (decodes, last chunks),
        // taken out of their sequences for the step: the backend asks for their masks once it has
        // queued the forward pass (`Backend::step_masked`)
        let mut grammars = StepMasks {
            constraints: plan
                .iter()
                .map(|&(i, _, b)| {
                    let s = &mut self.running[i];
                    if b >= s.prefill_end {
                        s.req.constraint.take()
                    } else {
                        None
                    }
                })
                .collect(),
            done: vec![None; plan.len()],
            count: 0,
            seconds: 0.0,
        };
        let lazy: Vec<bool> = grammars.constraints.iter().map(Option::is_some).collect();
        let outs: Vec<Result<SeqOutput, String>> =
            match self.run_plan(&plan, &lazy, &mut grammars, None) {
                Ok(Ok(outs)) if outs.len() == plan.len() => outs.into_iter().map(Ok).collect(),
                Ok(Ok(outs)) => {
                    let msg = format!(
                        "backend returned {} outputs for {} sequences",
                        outs.len(),
                        plan.len()
                    );
                    plan.iter().map(|_| Err(msg.clone())).collect()
                }
                // One bad entry (say, a token id outside the vocabulary) must not fail its
                // batch-mates: the backend refused the whole step before writing anything, so run
                // each alone (masks already computed are not computed again).
                Ok(Err(_)) if plan.len() > 1 => {
                    let mut outs = Vec::with_capacity(plan.len());
                    for (k, p) in plan.iter().enumerate() {
                        let one = self.run_plan(
                            std::slice::from_ref(p),
                            &lazy[k..=k],
                            &mut grammars,
                            Some(k),
                        );
                        outs.push(match one {
                            Ok(Ok(mut o)) if o.len() == 1 => Ok(o.pop().unwrap()),
                            Ok(Ok(_)) => Err("backend returned no output".to_string()),
                            Ok(Err(e)) => Err(format!("backend error: {e}")),
                            Err(msg) => return self.die(msg),
                        });
                    }
                    outs
                }
                Ok(Err(e)) => vec![Err(format!("backend error: {e}")); plan.len()],
                Err(msg) => return self.die(msg),
            };
        // proposals leave the histories: what was accepted comes back as generated tokens
        for &(i, _, _) in &plan {
            let s = &mut self.running[i];
            let keep = s.history.len() - s.drafted;
            s.history.truncate(keep);
        }
        self.m.grammar_masks_total += grammars.count;
        self.m.grammar_mask_seconds_total += grammars.seconds;
        // the grammars back into their sequences; one that failed ends its request alone
        let mut failed: Vec<Option<String>> = vec![None; plan.len()];
        for (k, (&(i, _, _), c)) in plan.iter().zip(grammars.constraints).enumerate() {
            if c.is_some() {
                self.running[i].req.constraint = c;
            }
            if let Some(Err(e)) = &grammars.done[k] {
                failed[k] = Some(format!("the grammar failed: {e}"));
            }
        }
        let outs: Vec<Result<SeqOutput, String>> = outs
            .into_iter()
            .zip(failed)
            .map(|(o, f)| match f {
                Some(msg) => Err(msg),
                None => o,
            })
            .collect();
        let now = Instant::now();
        for (&(i, a, b), out) in plan.iter().zip(outs) {
            let out = match out {
                Ok(o) => o,
                Err(msg) => {
                    ended.push((i, End::Error(msg)));
                    continue;
                }
            };
            let s = &mut self.running[i];
            let was_prefill = a < s.prefill_end;
            let prompt_len = s.req.prompt.len();
            let drafted = std::mem::take(&mut s.drafted);
            // the fed token and the accepted proposals are in the KV cache now (and in the draft
            // model's, up to what it was fed)
            s.cached = b - drafted + out.accepted.len();
            s.draft_cached = s.draft_cached.min(s.cached);
            if was_prefill {
                self.register_full_blocks(i);
                // prompt tokens computed (a preempted sequence's recomputation counts once more)
                self.m.prompt_tokens_total += (b.min(prompt_len).saturating_sub(a)) as u64;
                if self.running[i].prefilling() {
                    continue; // an intermediate chunk: its sample is not a generated token
                }
            }
            if drafted > 0 {
                self.m.spec_decode_num_drafts_total += 1;
                self.m.spec_decode_num_draft_tokens_total += drafted as u64;
                self.m.spec_decode_num_accepted_tokens_total += out.accepted.len() as u64;
            }
            // the generated tokens: the accepted proposals, then the sample after them
            let n = out.accepted.len() + 1;
            let samples = out.accepted.into_iter().chain(std::iter::once(
                metrale_backend::sampler::Sampled {
                    token: out.token,
                    logprob: out.logprob,
                    top_logprobs: out.top_logprobs,
                },
            ));
            for r in samples {
                if let Some(end) = self.generated(i, r, now, n) {
                    ended.push((i, end));
                    break;
                }
            }
            if !was_prefill {
                self.register_full_blocks(i);
            }
        }
        self.end_all(ended);
    }

    /// Proposals for the decoding sequences `decoding` (indices into `running`) to verify in this
    /// step, at most `budget` in all: none for a sequence under a grammar, none past its slot or its
    /// `max_tokens`.
    fn proposals(&mut self, decoding: &[usize], mut budget: usize) -> Vec<Vec<u32>> {
        let Some(sp) = &self.cfg.speculation else {
            return vec![Vec::new(); decoding.len()];
        };
        // room: positions cached + 1 .. stay in the slot; the accepted ones and the sample after
        // them stay within max_tokens
        let rooms: Vec<usize> = decoding
            .iter()
            .map(|&i| {
                let s = &self.running[i];
                if s.req.constraint.is_some() || s.req.embed.is_some() {
                    return 0;
                }
                let room = sp
                    .tokens
                    .min(budget)
                    .min(self.capacity.saturating_sub(s.cached + 1))
                    .min(s.req.max_tokens.saturating_sub(s.generated + 1));
                budget -= room;
                room
            })
            .collect();
        match sp.proposer {
            Proposer::Ngram { min, max } => decoding
                .iter()
                .zip(&rooms)
                .map(|(&i, &room)| spec::ngram(&self.running[i].history, min, max, room).to_vec())
                .collect(),
            Proposer::Draft => self.draft_proposals(decoding, &rooms),
        }
    }

    /// The draft model's greedy proposals (`Proposer::Draft`): one step brings each sequence's
    /// draft KV up to its history and samples the first proposal, then one step per further
    /// proposal, all sequences batched. A draft model that fails or panics proposes nothing (its
    /// state is unknown after a panic: it is dropped and the engine decodes plainly from then on).
    fn draft_proposals(&mut self, decoding: &[usize], rooms: &[usize]) -> Vec<Vec<u32>> {
        let mut props: Vec<Vec<u32>> = vec![Vec::new(); decoding.len()];
        let Some(draft) = self.draft.as_mut() else {
            return props;
        };
        let greedy = SamplingParams::default();
        let mut hist: Vec<Vec<u32>> = decoding
            .iter()
            .map(|&i| self.running[i].history.clone())
            .collect();
        let mut done: Vec<usize> = decoding
            .iter()
            .map(|&i| self.running[i].draft_cached)
            .collect();
        let tables: Vec<Vec<u32>> = decoding
            .iter()
            .map(|&i| metrale_backend::slot_blocks(self.running[i].slot, self.capacity))
            .collect();
        loop {
            let active: Vec<usize> = (0..decoding.len())
                .filter(|&w| props[w].len() < rooms[w])
                .collect();
            if active.is_empty() {
                break;
            }
            let steps: Vec<SeqStep<'_>> = active
                .iter()
                .map(|&w| SeqStep {
                    slot: self.running[decoding[w]].slot,
                    start_pos: done[w],
                    tokens: &hist[w][done[w]..],
                    blocks: &tables[w],
                    history: &hist[w],
                    sampling: &greedy,
                    draw: 0,
                    want_logits: false,
                    allowed: None,
                    drafted: 0,
                })
                .collect();
            let backend = &mut draft.backend;
            let t = Instant::now();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.step(&steps)));
            self.m.engine_backend_seconds_total += t.elapsed().as_secs_f64();
            let outs = match r {
                Ok(Ok(outs)) if outs.len() == active.len() => outs,
                Ok(_) => break, // refused: what was proposed so far stands
                Err(p) => {
                    eprintln!(
                        "speculative decoding is off from now on: the draft model failed: {}",
                        panic_message(p)
                    );
                    self.draft = None;
                    for &i in decoding {
                        self.running[i].draft_cached = 0;
                    }
                    return vec![Vec::new(); decoding.len()];
                }
            };
            for (&w, out) in active.iter().zip(outs) {
                done[w] = hist[w].len();
                hist[w].push(out.token);
                props[w].push(out.token);
            }
        }
        for (&i, d) in decoding.iter().zip(done) {
            self.running[i].draft_cached = d;
        }
        props
    }

    /// Give decoding sequence `i` the blocks its proposals need from the free pool (never
    /// preempting for them; the ones that do not fit are dropped) and append them to its history
    /// for the step; returns how many it carries (0: a plain decode).
    fn take_proposals(&mut self, i: usize, proposed: &[u32]) -> usize {
        let mut n = proposed.len();
        while n > 0 && self.running[i].blocks.len() < blocks_for(self.running[i].cached + 1 + n) {
            match self.pool.alloc() {
                Some(b) => self.running[i].blocks.push(b),
                None => n = self.running[i].blocks.len() * KV_BLOCK - self.running[i].cached - 1,
            }
        }
        let s = &mut self.running[i];
        s.history.extend_from_slice(&proposed[..n]);
        s.drafted = n;
        n
    }

    /// Stream generated token `r` of running sequence `i` (one of `n` this step): count it, check
    /// the stop token, the grammar and the length; returns how the sequence ends, if it does.
    fn generated(
        &mut self,
        i: usize,
        r: metrale_backend::sampler::Sampled,
        now: Instant,
        n: usize,
    ) -> Option<End> {
        let s = &mut self.running[i];
        s.generated += 1;
        self.m.generation_tokens_total += 1;
        match s.last_token_at {
            None => self
                .m
                .time_to_first_token_seconds
                .observe((now - s.submitted).as_secs_f64()),
            // the n tokens of one verification step share its interval
            Some(t) => self
                .m
                .inter_token_latency_seconds
                .observe((now - t).as_secs_f64() / n as f64),
        }
        s.last_token_at = Some(now);
        let is_stop = !s.req.ignore_eos && s.req.stop_tokens.contains(&r.token);
        let mut grammar_done = false;
        if let (Some(c), false) = (&mut s.req.constraint, is_stop) {
            if let Err(e) = c.0.commit(r.token) {
                return Some(End::Error(format!("the grammar failed: {e}")));
            }
            grammar_done = c.0.finished();
        }
        if is_stop {
            return Some(End::Stop);
        }
        s.history.push(r.token);
        let ev = Event::Token {
            id: r.token,
            logprob: r.logprob,
            top_logprobs: r.top_logprobs,
        };
        self.outbox.push((s.tx.clone(), ev));
        if grammar_done {
            Some(End::Stop) // the grammar is complete: nothing may follow
        } else if s.generated >= s.req.max_tokens {
            Some(End::Length)
        } else {
            None
        }
    }

    /// Finish the running sequences `ended` names (indices into `running`, any order).
    fn end_all(&mut self, mut ended: Vec<(usize, End)>) {
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (i, e) in ended {
            self.finish(i, e);
        }
    }

    /// Run the embedding requests' chunks of `eplan` through `Backend::hidden`: pool each chunk's
    /// hidden states into its sequence, and for a prompt whose last chunk this was, send the
    /// embedding and mark it ended. A refused batch ends its entries with the error; `Err` carries
    /// a panic message.
    fn run_hidden(
        &mut self,
        eplan: &[(usize, usize, usize)],
        ended: &mut Vec<(usize, End)>,
    ) -> Result<(), String> {
        let steps = seq_steps(&self.running, eplan);
        let backend = &mut self.backend;
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.hidden(&steps)));
        self.m.engine_backend_seconds_total += t.elapsed().as_secs_f64();
        let r = r.map_err(panic_message)?;
        let sums = match r {
            Ok(v) if v.len() == eplan.len() => v,
            Ok(v) => {
                let msg = format!(
                    "backend returned {} hidden states for {} sequences",
                    v.len(),
                    eplan.len()
                );
                ended.extend(eplan.iter().map(|&(i, _, _)| (i, End::Error(msg.clone()))));
                return Ok(());
            }
            Err(e) => {
                let msg = format!("backend error: {e}");
                ended.extend(eplan.iter().map(|&(i, _, _)| (i, End::Error(msg.clone()))));
                return Ok(());
            }
        };
        for (&(i, a, b), h) in eplan.iter().zip(sums) {
            self.running[i].cached = b;
            self.register_full_blocks(i);
            self.m.prompt_tokens_total += (b - a) as u64;
            let s = &mut self.running[i];
            s.hidden.extend(h);
            if !s.prefilling() {
                let pooling = s.req.embed.unwrap_or(Pooling::Mean);
                let ev = Event::Embedding(s.hidden.embedding(pooling));
                self.outbox.push((s.tx.clone(), ev));
                ended.push((i, End::Stop));
            }
        }
        Ok(())
    }

    /// Run one backend step over `plan`, the entries flagged in `lazy` asking `grammars` for their
    /// masks (`entry`: the plan index of a one-entry retry); `Err` carries a panic message.
    fn run_plan(
        &mut self,
        plan: &[(usize, usize, usize)],
        lazy: &[bool],
        grammars: &mut StepMasks,
        entry: Option<usize>,
    ) -> Result<Result<Vec<SeqOutput>, BackendError>, String> {
        let steps = seq_steps(&self.running, plan);
        let backend = &mut self.backend;
        let mut masks = Retry(grammars, entry);
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            backend.step_masked(&steps, lazy, &mut masks)
        }));
        self.m.engine_backend_seconds_total += t.elapsed().as_secs_f64();
        r.map_err(panic_message)
    }

    /// The backend panicked: its state is unknown, so end every request and refuse new ones.
    fn die(&mut self, msg: String) {
        if let Some(sh) = self.shared.upgrade() {
            *sh.dead.lock().unwrap() = Some(msg.clone());
        }
        for i in (0..self.running.len()).rev() {
            self.finish(i, End::Error(msg.clone()));
        }
        for w in std::mem::take(&mut self.waiting) {
            let tx = match w {
                Waiting::New(s) => {
                    self.admitted(1);
                    s.tx
                }
                Waiting::Blocked(s) => {
                    self.admitted(1);
                    s.tx
                }
                Waiting::Preempted(s) => s.tx,
            };
            self.outbox.push((tx, Event::Error(msg.clone())));
        }
    }

    /// End running sequence `i`: send its last event, free its slot, record metrics.
    fn finish(&mut self, i: usize, end: End) {
        let s = self.running.swap_remove(i);
        self.backend.release(s.slot);
        if let Some(d) = &mut self.draft {
            d.backend.release(s.slot);
        }
        self.free.push(s.slot);
        // registered full blocks stay cached for later prompts; the others are free again
        for &b in &s.blocks {
            self.pool.release(b);
        }
        let (prompt_tokens, completion_tokens) = (s.req.prompt.len(), s.generated);
        let (k, ev) = match end {
            End::Stop => (
                0,
                Some(Event::Done {
                    reason: FinishReason::Stop,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens: s.reused,
                }),
            ),
            End::Length => (
                1,
                Some(Event::Done {
                    reason: FinishReason::Length,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens: s.reused,
                }),
            ),
            // the caller's receiver is gone: a stop string it matched, or a cancellation
            End::Abort if s.req.link.stop_string.load(Ordering::Acquire) => (0, None),
            End::Abort => (2, None),
            End::Error(msg) => (3, Some(Event::Error(msg))),
        };
        if let Some(ev) = ev {
            self.outbox.push((s.tx, ev));
        }
        self.m.request_success_total[k].1 += 1;
        if k < 2 {
            self.m
                .e2e_request_latency_seconds
                .observe(s.submitted.elapsed().as_secs_f64());
        }
    }
}

/// The backend's entries of `plan` (index into `running`, tokens `a..b` of its history): each
/// sequence's chunk, its block table, and its sampling draw (an embedding has generated none).
fn seq_steps<'a>(running: &'a [Seq], plan: &[(usize, usize, usize)]) -> Vec<SeqStep<'a>> {
    plan.iter()
        .map(|&(i, a, b)| {
            let s = &running[i];
            SeqStep {
                slot: s.slot,
                start_pos: a,
                tokens: &s.history[a..b],
                blocks: &s.blocks,
                history: &s.history[..b],
                sampling: &s.req.sampling,
                draw: s.generated as u64,
                want_logits: false,
                allowed: None,
                // a decode entry's proposals end its history (prefill chunks have none)
                drafted: if b == s.history.len() { s.drafted } else { 0 },
            }
        })
        .collect()
}

/// What a caught backend panic says, for the requests it ends.
fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    let msg = p
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into());
    format!("the backend panicked: {msg}")
}

#[cfg(test)]
mod tests;
