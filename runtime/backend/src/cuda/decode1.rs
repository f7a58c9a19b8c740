//! The persistent batch-1 decode kernel (`decode_1` in kernels/cuda/decode.cu.hbs): a whole decode
//! step of one sequence (embedding, every layer, LM head with the greedy choice) in one cooperative
//! launch, the stages handing their outputs over through tagged 64-bit words (`xch`) instead of
//! kernel boundaries. The backend uses it for every pure decode step of one sequence unless
//! `Tuning::persistent_decode` is off.
//!
//! Owns the kernel's device state: the per-layer weight-pointer table, the exchange buffer, the trace
//! buffer, the launch epoch, and the arguments that never change between launches. Its layout sizes
//! are the ABI's (`metrale_abi::layout`), which the kernel asserts at compile time.
//!
//! Invariants:
//! - Every launch gets a fresh epoch; tags are `epoch * (layers + 1) + layer` in u32, never 0 (the
//!   value of a zeroed word). Before a tag could wrap, the exchange buffer is zeroed and the epoch
//!   restarts at 1, so a stale word can never carry the current tag.
//! - The grid never exceeds the row pairs of the smallest product (every block must produce in every
//!   product: that is what makes rewriting an exchange buffer safe) and always holds the
//!   `kv_heads * max_splits` attention blocks (`plan::decode1_fit_split` lowers the splits to fit);
//!   all blocks are co-resident (cooperative launch).

use metrale_abi::layout::{decode_exchange_words, decode_smem_bytes, decode_trace_words};
use metrale_abi::{DECODE_FLAG_TRACE, TOKEN_FROM_DEVICE};
use metrale_core::BackendError;

use super::device::DevBuf;
use super::launch::{Gpu, Occupancy};
use super::plan;

/// Inputs of one launch besides the fixed buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The input token, or [`Step::FROM_DEVICE`].
    pub token: i32,
    pub pos: i32,
    pub slot: i32,
}

impl Step {
    /// The token that makes the kernel read its input from `out_tok`: the greedy pick of the launch
    /// before it in the stream (run-ahead).
    pub const FROM_DEVICE: i32 = TOKEN_FROM_DEVICE;
}

/// The kernel's device state.
pub struct Decode1 {
    _layers: DevBuf,
    xch: DevBuf,
    trace: DevBuf,
    epoch: u32,
    n_layers: usize,
    /// The arguments of every launch (weights, caches, outputs); each launch sets the step's.
    base: metrale_abi::DecodeOne,
    pub blocks: u32,
    pub smem_bytes: u32,
    /// (split_len, max_splits)
    pub split: (usize, usize),
    /// The driver's occupancy and resources of the loaded kernel at this grid.
    pub occupancy: Occupancy,
}

impl Decode1 {
    /// Set up the kernel for `layers` on `gpu` with the target's attention `split`; `base` holds the
    /// arguments that never change (its step fields are ignored). `None` when the device cannot run
    /// it (too few SMs for the attention blocks, or no room for one block per SM).
    pub fn new(
        gpu: &Gpu,
        layers: &[metrale_abi::device::LayerW],
        split: (usize, usize),
        base: metrale_abi::DecodeOne,
    ) -> Result<Option<Decode1>, BackendError> {
        let d = gpu.dims;
        let Some(blocks) = plan::decode1_blocks(&d, gpu.sm_count) else {
            return Ok(None);
        };
        let split = plan::decode1_fit_split(&d, blocks, split);
        let smem = decode_smem_bytes(&d, blocks as usize);
        let Some(occupancy) = gpu.decode1_prepare(smem)? else {
            return Ok(None);
        };
        if occupancy.per_sm < 1 {
            return Ok(None);
        }
        let lw = gpu.upload(layers)?;
        let xch = gpu.alloc(decode_exchange_words(&d) * 8)?;
        let trace = gpu.alloc(decode_trace_words(&d, blocks as usize) * 8)?;
        let base = metrale_abi::DecodeOne {
            lw: lw.ptr,
            xch: xch.ptr,
            trace: trace.ptr,
            att_cfg: plan::decode1_att_cfg(split),
            ..base
        };
        Ok(Some(Decode1 {
            _layers: lw,
            xch,
            trace,
            epoch: 0,
            n_layers: d.layers,
            base,
            blocks,
            smem_bytes: smem as u32,
            split,
            occupancy,
        }))
    }

    /// The next launch's epoch: fresh, and with room for every layer's tag in u32 (else the exchange
    /// buffer is zeroed first and the epochs restart).
    fn next_epoch(&mut self, gpu: &Gpu) -> Result<u32, BackendError> {
        let per = self.n_layers as u64 + 1;
        let next = self.epoch as u64 + 1;
        if (next + 1) * per >= u32::MAX as u64 {
            gpu.zero_async(&self.xch)?;
            self.epoch = 1;
        } else {
            self.epoch = next as u32;
        }
        Ok(self.epoch)
    }

    /// Enqueue one decode step (outputs in the backend's logits / out_tok / out_lp buffers); with
    /// `trace`, the kernel writes its per-stage timestamps (see [`Decode1::read_trace`]).
    pub fn launch(&mut self, gpu: &Gpu, s: Step, trace: bool) -> Result<(), BackendError> {
        let epoch = self.next_epoch(gpu)?;
        let a = metrale_abi::DecodeOne {
            token: s.token,
            pos: s.pos,
            slot: s.slot,
            epoch,
            flags: if trace { DECODE_FLAG_TRACE as i32 } else { 0 },
            ..self.base
        };
        gpu.decode_1(self.blocks, self.smem_bytes, a)
    }

    /// The trace of the last launch run with `trace`: `metrale_abi::layout::decode_trace_words`
    /// globaltimer stamps.
    pub fn read_trace(&self, gpu: &Gpu) -> Result<Vec<u64>, BackendError> {
        let mut t = vec![0u64; self.trace.bytes / 8];
        gpu.read(&self.trace, 0, &mut t)?;
        Ok(t)
    }
}
