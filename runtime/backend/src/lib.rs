//! metrale-backend: the `Backend` trait (the seam between the engine and the hardware), the `cpu`
//! reference backend and, behind the `cuda` feature, the CUDA backend.
//!
//! A backend owns the weights on its device and the KV cache, runs the model over a batch of sequence
//! chunks (prefill chunks and single decode tokens mixed) and samples the next token of each on the
//! device, so that only token ids (and requested logprobs) cross back. The `cpu` backend is the
//! numerical reference every other backend is tested against: its ops are public in `cpu::ops`.
//!
//! Invariants: only this crate's `cuda` module links the CUDA driver; nothing here knows HTTP.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod sampler;
pub mod shape;

use metrale_core::BackendError;

/// Index of a KV-cache slot: one running sequence owns one slot until it is released.
pub type SlotId = usize;

/// What the engine asks of the backend for one sequence in one step.
#[derive(Debug)]
pub struct SeqStep<'a> {
    /// KV-cache slot of the sequence.
    pub slot: SlotId,
    /// Position of `tokens[0]` in the sequence (= tokens already in the slot's KV cache).
    pub start_pos: usize,
    /// New tokens: a prefill chunk, or exactly one token when decoding.
    pub tokens: &'a [u32],
    /// Every token of the sequence so far including `tokens` (for repetition/presence/frequency
    /// penalties).
    pub history: &'a [u32],
    /// How to pick the next token.
    pub sampling: &'a sampler::SamplingParams,
    /// Index of this sampling draw in the sequence (0 for the first generated token): with the seed,
    /// it fixes the random number used, so the same seed gives the same output on every backend.
    pub draw: u64,
    /// Return the full logits row of the last position (tests and logprob-heavy callers only).
    pub want_logits: bool,
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
    /// Logits of the last position when `want_logits` was set.
    pub logits: Option<Vec<f32>>,
}

/// Static facts a backend reports once it is loaded.
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// "cpu" or "cuda".
    pub name: String,
    /// Human-readable device, e.g. "NVIDIA H200 (sm_90, 132 SMs)" or "cpu (2 threads)".
    pub device: String,
    /// Number of KV-cache slots (maximum concurrent sequences).
    pub slots: usize,
    /// Tokens each slot can hold.
    pub slot_capacity: usize,
    /// Bytes of weights resident on the device.
    pub weight_bytes: u64,
    /// Bytes of KV cache.
    pub kv_bytes: u64,
}

/// A loaded model on a device.
pub trait Backend: Send {
    fn info(&self) -> BackendInfo;
    /// Run the batch and sample one token per entry. Entries use distinct slots.
    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<SeqOutput>, BackendError>;
    /// The slot's sequence has ended: the slot is free for a new one. Its KV entries stay as they
    /// are until a later step overwrites them (the engine's prefix caching resumes a new sequence
    /// after the positions it shares with them).
    fn release(&mut self, slot: SlotId);
}
