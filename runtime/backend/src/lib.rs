//! metrale-backend: the `Backend` trait (the seam between the engine and the hardware), the `cpu`
//! reference backend and, behind the `cuda` feature, the CUDA backend.
//!
//! A backend owns the weights on its device and the KV cache, runs the model over a batch of sequence
//! chunks (prefill chunks and single decode tokens mixed) and samples the next token of each on the
//! device, so that only token ids (and requested logprobs) cross back. The `cpu` backend is the
//! numerical reference every other backend is tested against: its ops are public in `cpu::ops`.
//!
//! What both backends share sits here, at the seam: the step types and [`validate_batch`] (one
//! message set for a bad batch), [`stage`] (the forward pass as one list of stages both walk),
//! [`rope`] (the rotation both apply), [`numerics`] (the exponential
//! of attention and sampling) and the host [`sampler`] (the reference of the device sampler).
//! Layers run one way: `cuda` and `cpu` use the seam; neither imports the other.
//!
//! Invariants: only this crate's `cuda` module links the CUDA driver; nothing here knows HTTP.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod numerics;
pub mod pipeline;
pub mod rope;
pub mod sampler;
pub mod stage;

use metrale_core::BackendError;

pub use metrale_core::shape::{Dims, KvDtype, KV_BLOCK};

/// Index of a slot: one running sequence owns one slot (its place in a step's batch, its per-sequence
/// backend state) until it is released. Its KV entries live in blocks of the shared pool.
pub type SlotId = usize;

/// The KV cache a backend allocates: one pool of blocks of [`KV_BLOCK`] tokens shared by every
/// sequence (each reaches its positions through its block table, `SeqStep::blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// Sequences in flight at once.
    pub slots: usize,
    /// Most positions of one sequence (the context size).
    pub slot_capacity: usize,
    /// Blocks in the pool; 0: every slot at full capacity (`slots x blocks_for(slot_capacity)`),
    /// which [`slot_blocks`] tables address.
    pub blocks: usize,
    pub dtype: KvDtype,
}

impl KvConfig {
    /// Every slot at full capacity, f32 (what a caller without a block allocator wants).
    pub fn per_slot(slots: usize, slot_capacity: usize) -> KvConfig {
        KvConfig {
            slots,
            slot_capacity,
            blocks: 0,
            dtype: KvDtype::F32,
        }
    }

    /// The pool's block count (resolving 0).
    pub fn pool_blocks(&self) -> usize {
        if self.blocks == 0 {
            self.slots.saturating_mul(blocks_for(self.slot_capacity))
        } else {
            self.blocks
        }
    }
}

/// Blocks that hold `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(KV_BLOCK)
}

/// The block table of `slot` in a pool laid out [`KvConfig::per_slot`]: the slot's own run of
/// blocks. For callers that drive a backend without the engine's allocator (tests, benchmarks).
pub fn slot_blocks(slot: SlotId, slot_capacity: usize) -> Vec<u32> {
    let n = blocks_for(slot_capacity);
    (slot * n..(slot + 1) * n).map(|b| b as u32).collect()
}

/// What the engine asks of the backend for one sequence in one step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// KV-cache slot of the sequence.
    pub slot: SlotId,
    /// Position of `tokens[0]` in the sequence (= tokens already in its KV blocks).
    pub start_pos: usize,
    /// New tokens: a prefill chunk, or exactly one token when decoding.
    pub tokens: &'a [u32],
    /// The sequence's block table: position `p` lives in pool block `blocks[p / KV_BLOCK]`. Covers
    /// at least `start_pos + tokens.len()` positions. Blocks holding a shared prefix may appear in
    /// several sequences' tables; a step writes only positions `start_pos..`, which lie in blocks no
    /// other sequence reads (the engine's contract).
    pub blocks: &'a [u32],
    /// Every token of the sequence so far including `tokens` (for repetition/presence/frequency
    /// penalties).
    pub history: &'a [u32],
    /// How to pick the next token.
    pub sampling: &'a sampler::SamplingParams,
    /// Index of this sampling draw in the sequence (0 for the first generated token): with the seed,
    /// it fixes the random number used, so the same seed gives the same output on every backend.
    pub draw: u64,
    /// Return the full logits row of the last position (tests and logprob-heavy callers only); of
    /// a verification entry (`drafted` > 0), the rows of its last `drafted + 1` positions.
    pub want_logits: bool,
    /// The tokens the next one may be (a grammar's mask: bit `t % 32` of word `t / 32`), applied to
    /// the logits before sampling ([`sampler::apply_mask`]); `None`: any token.
    pub allowed: Option<&'a [u32]>,
    /// Speculative verification: the last `drafted` of `tokens` are proposed continuations (from a
    /// proposer, not yet accepted). The step samples at each of the last `drafted + 1` positions
    /// and accepts proposals in order ([`sampler::verify`]): the answer's `accepted` holds the
    /// accepted ones, `token` the sample after the last of them. The KV entries of the rejected
    /// proposals' positions are written but hold nothing: the caller's next step starts at the
    /// first of them and overwrites them. 0: a plain step. Needs `drafted < tokens.len()` and no
    /// `allowed` mask (a grammar decides one token at a time).
    pub drafted: usize,
}

/// The backend's answer for one `SeqStep`.
#[derive(Debug, Clone)]
pub struct SeqOutput {
    /// The sampled next token.
    pub token: u32,
    /// log-softmax of the sampled token under the logits plus the request's logit bias (no penalties).
    pub logprob: f32,
    /// The `sampling.top_logprobs` most likely tokens with their logprobs, best first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Logits of the last position when `want_logits` was set (`[vocab]`); of a verification
    /// entry's last `drafted + 1` positions (`[drafted + 1][vocab]`).
    pub logits: Option<Vec<f32>>,
    /// The proposals of a verification step (`SeqStep::drafted`) that were accepted, in order, each
    /// with its logprob and top logprobs; they come before `token`. Empty for a plain step.
    pub accepted: Vec<sampler::Sampled>,
}

/// One entry's hidden states from [`Backend::hidden`]: the final-normed hidden state of each of its
/// tokens summed (`[hidden]`), and that of its last token (`[hidden]`). Embeddings pool these over a
/// prompt's chunks ([`Pooling`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HiddenSums {
    pub sum: Vec<f32>,
    pub last: Vec<f32>,
    /// Tokens summed.
    pub tokens: usize,
}

impl HiddenSums {
    /// `other` (a later chunk of the same sequence) added: the sums add, its last row replaces ours.
    pub fn extend(&mut self, other: HiddenSums) {
        if self.tokens == 0 {
            *self = other;
            return;
        }
        for (a, b) in self.sum.iter_mut().zip(&other.sum) {
            *a += b;
        }
        self.last = other.last;
        self.tokens += other.tokens;
    }

    /// The embedding: the pooled hidden state scaled to unit L2 norm (a zero vector stays zero).
    pub fn embedding(&self, pooling: Pooling) -> Vec<f32> {
        let mut v: Vec<f32> = match pooling {
            Pooling::Mean => {
                let n = self.tokens.max(1) as f32;
                self.sum.iter().map(|x| x / n).collect()
            }
            Pooling::Last => self.last.clone(),
        };
        let norm = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        if norm > 0.0 {
            for x in &mut v {
                *x = (*x as f64 / norm) as f32;
            }
        }
        v
    }
}

/// How the final-normed hidden states of a prompt's tokens become one embedding: their mean, or the
/// last token's (what a causal model has seen everything at), then scaled to unit length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    Mean,
    Last,
}

impl Pooling {
    /// `mean` or `last`; anything else is an error naming the choices.
    pub fn parse(s: &str) -> Result<Pooling, String> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            o => Err(format!(
                "pooling `{o}` is not supported; the choices are mean, last"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Last => "last",
        }
    }
}

/// Static facts a backend reports once it is loaded.
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// "cpu" or "cuda".
    pub name: String,
    /// Human-readable device, e.g. "NVIDIA H200 (sm_90, 132 SMs)" or "cpu (2 threads)".
    pub device: String,
    /// Number of slots (maximum concurrent sequences).
    pub slots: usize,
    /// Most positions of one sequence.
    pub slot_capacity: usize,
    /// Blocks of [`KV_BLOCK`] tokens in the KV pool.
    pub kv_blocks: usize,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// Bytes of weights resident on the device.
    pub weight_bytes: u64,
    /// Bytes of KV cache.
    pub kv_bytes: u64,
    /// Whether `step` runs verification entries (`SeqStep::drafted` > 0).
    pub verifies_drafts: bool,
    /// Most prompt tokens of one sequence a step should carry, where the backend measured that
    /// more in one step costs more than another step (`None`: as many as the step budget allows).
    pub prefill_chunk: Option<usize>,
}

/// Logits of a prompt prefilled in steps of at most `chunk` tokens (`None`: one step), then of
/// each token of `decode` fed alone (teacher forcing), greedy, in slot 0 of a pool laid out
/// [`KvConfig::per_slot`]: the rows a reference implementation's golden is compared with (tests
/// and tools). The first row is the prompt's last position.
pub fn teacher_forced_logits(
    b: &mut dyn Backend,
    prompt: &[u32],
    decode: &[u32],
    chunk: Option<usize>,
) -> Result<Vec<Vec<f32>>, BackendError> {
    let table = slot_blocks(0, b.info().slot_capacity);
    let p = sampler::SamplingParams::default();
    let chunk = chunk.unwrap_or(prompt.len()).max(1);
    let mut hist = Vec::with_capacity(prompt.len() + decode.len());
    let mut pieces: Vec<&[u32]> = prompt.chunks(chunk).collect();
    pieces.extend(decode.chunks(1));
    let mut rows = Vec::with_capacity(decode.len() + 1);
    let prompt_steps = prompt.len().div_ceil(chunk);
    for (i, toks) in pieces.iter().enumerate() {
        let start = hist.len();
        hist.extend_from_slice(toks);
        // the last prompt chunk gives the first row; each decode token's step the next
        let want = i + 1 >= prompt_steps;
        let s = SeqStep {
            slot: 0,
            blocks: &table,
            start_pos: start,
            tokens: toks,
            history: &hist,
            sampling: &p,
            draw: 0,
            want_logits: want,
            allowed: None,
            drafted: 0,
        };
        let out = b.step(&[s])?.pop();
        if want {
            rows.push(out.and_then(|o| o.logits).ok_or_else(|| {
                BackendError::Invalid("the backend returned no logits row".into())
            })?);
        }
    }
    Ok(rows)
}

/// Where the grammar masks of a step's entries come from when they are computed on demand
/// ([`Backend::step_masked`]).
pub trait MaskSource {
    /// Entry `i`'s allowed-token mask (as [`SeqStep::allowed`]); `None` leaves it unconstrained
    /// (a grammar that failed: the source keeps the error for its caller).
    fn mask(&mut self, i: usize) -> Option<Vec<u32>>;
}

/// No entry is constrained on demand.
pub struct NoMasks;

impl MaskSource for NoMasks {
    fn mask(&mut self, _: usize) -> Option<Vec<u32>> {
        None
    }
}

/// A loaded model on a device.
pub trait Backend: Send {
    fn info(&self) -> BackendInfo;
    /// Run the batch and sample one token per entry. Entries use distinct slots.
    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<SeqOutput>, BackendError>;
    /// [`Backend::step`], where the entries flagged in `lazy` take their grammar mask from `masks`
    /// (each asked at most once per call). A backend that computes asynchronously asks for a mask
    /// after queuing the forward pass that samples its entry, so the host's grammar work overlaps
    /// the device's (a mask depends only on the tokens before it); this default asks for them all
    /// first.
    fn step_masked(
        &mut self,
        batch: &[SeqStep<'_>],
        lazy: &[bool],
        masks: &mut dyn MaskSource,
    ) -> Result<Vec<SeqOutput>, BackendError> {
        let owned: Vec<Option<Vec<u32>>> = (0..batch.len())
            .map(|i| {
                if lazy.get(i) == Some(&true) {
                    masks.mask(i)
                } else {
                    None
                }
            })
            .collect();
        let steps: Vec<SeqStep<'_>> = batch
            .iter()
            .zip(&owned)
            .map(|(s, m)| SeqStep {
                allowed: m.as_deref().or(s.allowed),
                ..*s
            })
            .collect();
        self.step(&steps)
    }
    /// Run the batch's tokens through the layers, writing their K/V as [`Backend::step`] does, and
    /// return each entry's final-normed hidden states ([`HiddenSums`]) instead of sampling: the
    /// embeddings path. `sampling`, `draw`, `want_logits` and `allowed` are ignored.
    fn hidden(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<HiddenSums>, BackendError>;
    /// The slot's sequence has ended: the slot is free for a new one. KV blocks belong to the
    /// caller's allocator; their entries stay as they are until a later step overwrites them (the
    /// engine's prefix caching hands full blocks to later sequences that share their tokens).
    fn release(&mut self, slot: SlotId);
}

/// Refuse a batch no backend can run, before any work: entry `i` names a slot outside `0..slots` or
/// one used twice, has no tokens, reaches past `capacity` positions, has a block table too short for
/// its positions or naming a block outside the pool of `kv_blocks`, or holds a token id outside
/// `0..vocab`. Every backend calls this first, so a bad batch gets the same message on every one.
pub fn validate_batch(
    batch: &[SeqStep<'_>],
    slots: usize,
    capacity: usize,
    kv_blocks: usize,
    vocab: usize,
) -> Result<(), BackendError> {
    let bad = |i: usize, what: String| Err(BackendError::Invalid(format!("entry {i}: {what}")));
    let mut used = vec![false; slots];
    for (i, s) in batch.iter().enumerate() {
        if s.slot >= slots {
            return bad(
                i,
                format!("slot {} does not exist (the backend has {slots})", s.slot),
            );
        }
        if std::mem::replace(&mut used[s.slot], true) {
            return bad(i, format!("slot {} appears twice in one step", s.slot));
        }
        if s.tokens.is_empty() {
            return bad(i, "no tokens (a step needs at least one)".into());
        }
        if s.start_pos
            .checked_add(s.tokens.len())
            .is_none_or(|e| e > capacity)
        {
            return bad(
                i,
                format!(
                    "positions {}..{} exceed the slot capacity of {capacity} tokens",
                    s.start_pos,
                    s.start_pos.saturating_add(s.tokens.len())
                ),
            );
        }
        let end = s.start_pos + s.tokens.len();
        if s.blocks.len() < blocks_for(end) {
            return bad(
                i,
                format!(
                    "a block table of {} blocks does not cover positions 0..{end} ({} blocks of {KV_BLOCK})",
                    s.blocks.len(),
                    blocks_for(end)
                ),
            );
        }
        if let Some(&b) = s.blocks[..blocks_for(end)]
            .iter()
            .find(|&&b| b as usize >= kv_blocks)
        {
            return bad(
                i,
                format!("block {b} is outside the KV pool ({kv_blocks} blocks)"),
            );
        }
        if s.allowed.is_some_and(|m| m.len() < vocab.div_ceil(32)) {
            return bad(
                i,
                format!(
                    "an allowed-token mask of {} words does not cover the vocabulary ({vocab} tokens)",
                    s.allowed.map_or(0, <[u32]>::len)
                ),
            );
        }
        if s.drafted >= s.tokens.len() {
            return bad(
                i,
                format!(
                    "{} proposed tokens need at least one accepted token before them ({} tokens)",
                    s.drafted,
                    s.tokens.len()
                ),
            );
        }
        if s.drafted > 0 && s.allowed.is_some() {
            return bad(
                i,
                "proposed tokens cannot be verified under an allowed-token mask".into(),
            );
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return bad(
                i,
                format!("token id {t} is outside the vocabulary ({vocab} tokens)"),
            );
        }
    }
    Ok(())
}
