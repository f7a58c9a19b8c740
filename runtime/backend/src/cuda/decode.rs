//! The persistent batch-1 decode kernel (`decode_1` in kernels/cuda/decode.cu.hbs): a whole decode
//! step of one sequence (embedding, every layer, LM head with the greedy choice) in one cooperative
//! launch, the stages handing their outputs over through tagged 64-bit words (`xch`) instead of
//! kernel boundaries. The backend uses it for every pure decode step of one sequence;
//! `METRALE_CUDA_DECODE1=0` turns it off (the per-stage kernels and their graphs run instead).
//!
//! This file mirrors the kernel's constants (each says which) and owns the kernel's device state:
//! the per-layer weight-pointer table, the exchange buffer and the launch epoch.
//!
//! Invariants:
//! - Every launch gets a fresh epoch; tags are `epoch * (layers + 1) + layer` in u32, never 0 (the
//!   value of a zeroed word). Before a tag could wrap, the exchange buffer is zeroed and the epoch
//!   restarts at 1, so a stale word can never carry the current tag.
//! - The grid never exceeds the row pairs of the smallest product (every block must produce in every
//!   product: that is what makes rewriting an exchange buffer safe) and always holds the
//!   `kv_heads * max_splits` attention blocks (`fit_split` lowers the splits to fit); all blocks are
//!   co-resident (cooperative launch).

use metrale_core::BackendError;

use super::gpu::{DevBuf, DevMat, Dims, Gpu};

/// Threads per block (`THREADS`).
pub const THREADS: u32 = 512;
/// Most attention splits per KV head the kernel is compiled for (`MAXS`).
pub const MAX_SPLITS: usize = 16;
/// K/V positions staged in shared memory at a time (`TILE`).
pub const TILE: usize = 64;
/// Trace stamps per (block, layer) (`NSTAMP`).
pub const NSTAMP: usize = 12;
/// Default attention split: positions per split before another split is added, and the most splits
/// per KV head (the launch's `att_cfg`). `METRALE_CUDA_DECODE1_SPLITS=LEN,MAX` overrides it. (32, 16)
/// measured 1.5% faster than (32, 8) side by side (bench/cuda/NOTES.md, session 2 final call) and
/// halves the serial K/V tiles per block at long contexts.
pub const DEFAULT_SPLIT: (usize, usize) = (32, 16);
/// Default `flags`: bit 0 = L2 prefetch of the next layer's weights, bit 1 = L2 prefetch of the LM
/// head during the last layers, bits 8..23 = the poll backoff in ns (bit 2, the trace, is for `CudaBackend::trace_decode1`).
/// `METRALE_CUDA_DECODE1_FLAGS` overrides it (benchmarks).
pub const DEFAULT_FLAGS: i32 = 0;

/// Attention splits per KV head for a sequence of `len` positions under `(split_len, max_splits)`
/// (the kernel's `ns`).
pub fn splits(len: usize, (split_len, max_splits): (usize, usize)) -> usize {
    len.max(1)
        .div_ceil(split_len.max(1))
        .min(max_splits.min(MAX_SPLITS))
        .max(1)
}

fn padded(k: usize) -> usize {
    (k / 32) * 36
}

/// Words of one split's attention partial (`PW`: max and sum per query head of the group, then
/// the group's unnormalised outputs).
fn partial_words(d: &Dims) -> usize {
    (d.heads / d.kv_heads) * (2 + d.head_dim)
}

/// The four layer products as (row pairs, 32-element quant blocks per row): QKV, O, gate/up
/// (interleaved, one pair per FFN row), down.
fn products(d: &Dims) -> [(usize, usize); 4] {
    [
        ((d.qd() + 2 * d.kd()) / 2, d.hidden / 32),
        (d.hidden / 2, d.qd() / 32),
        (d.ffn, d.hidden / 32),
        (d.hidden / 2, d.ffn / 32),
    ]
}

/// u64 words of the exchange buffer (`X_H + FFN`).
pub fn exchange_words(d: &Dims) -> usize {
    d.hidden + (d.qd() + 2 * d.kd()) + d.kv_heads * MAX_SPLITS * partial_words(d) + d.hidden + d.ffn
}

/// Bytes of dynamic shared memory for a grid of `blocks` blocks (`(S_PART + part_floats(blocks)) * 4`):
/// the fixed regions, then the unit partials of the largest product share (`units`).
pub fn smem_bytes(d: &Dims, blocks: usize) -> usize {
    let group = d.heads / d.kv_heads;
    let ks = d.head_dim + 4;
    let vecn = padded(d.hidden).max(padded(d.qd())).max(padded(d.ffn));
    let facn = (d.heads * MAX_SPLITS).div_ceil(4) * 4;
    let kvn = (2 * TILE * ks).max(d.kv_heads * MAX_SPLITS * partial_words(d));
    let s_part =
        2 * d.hidden + vecn + group * d.head_dim + 2 * d.head_dim + d.head_dim + facn + kvn;
    let part = products(d)
        .iter()
        .map(|&(pairs, nb)| pairs.div_ceil(blocks) * 2 * nb)
        .max()
        .unwrap_or(0);
    (s_part + part) * 4
}

/// Blocks of the grid on a device of `sm_count` SMs: one per SM, at most the row pairs of the
/// smallest product (every block must produce in every product); `None` when the grid could not
/// hold one attention block per KV head.
pub fn blocks(d: &Dims, sm_count: usize) -> Option<u32> {
    let min_pairs = products(d).iter().map(|p| p.0).min().unwrap_or(0);
    let n = sm_count.min(min_pairs);
    (n >= d.kv_heads).then_some(n as u32)
}

/// The attention split a grid of `blocks` blocks can run: `want`'s most splits per KV head reduced
/// so that `kv_heads * max_splits` attention blocks fit in the grid.
pub fn fit_split(d: &Dims, blocks: u32, want: (usize, usize)) -> (usize, usize) {
    (
        want.0,
        want.1
            .min(blocks as usize / d.kv_heads.max(1))
            .clamp(1, MAX_SPLITS),
    )
}

/// One layer's weight pointers (`LayerW`; ten 8-byte fields, C layout).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerPtrs {
    pub attn_norm: u64,
    pub qkv_qs: u64,
    pub qkv_sc: u64,
    pub o_qs: u64,
    pub o_sc: u64,
    pub ffn_norm: u64,
    pub gu_qs: u64,
    pub gu_sc: u64,
    pub down_qs: u64,
    pub down_sc: u64,
}

impl From<&super::LayerW> for LayerPtrs {
    fn from(w: &super::LayerW) -> LayerPtrs {
        LayerPtrs {
            attn_norm: w.attn_norm.ptr,
            qkv_qs: w.wqkv.qs.ptr,
            qkv_sc: w.wqkv.sc_ptr(),
            o_qs: w.wo.qs.ptr,
            o_sc: w.wo.sc_ptr(),
            ffn_norm: w.ffn_norm.ptr,
            gu_qs: w.wgu.qs.ptr,
            gu_sc: w.wgu.sc_ptr(),
            down_qs: w.wdown.qs.ptr,
            down_sc: w.wdown.sc_ptr(),
        }
    }
}

/// `Step::token` that makes the kernel read its token from `out_tok`: the greedy pick of the launch
/// before it in the stream (run-ahead, `super` module docs).
pub const TOKEN_FROM_DEVICE: i32 = -1;

/// Inputs of one launch besides the backend's buffers.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    /// The input token, or `TOKEN_FROM_DEVICE`.
    pub token: i32,
    pub pos: i32,
    pub slot: i32,
}

/// The kernel's device state.
pub struct Decode1 {
    layers: DevBuf,
    xch: DevBuf,
    trace: DevBuf,
    epoch: u32,
    n_layers: usize,
    pub blocks: u32,
    pub smem_bytes: u32,
    pub flags: i32,
    /// (split_len, max_splits)
    pub split: (usize, usize),
    /// (registers per thread, local memory bytes per thread) of the loaded kernel
    pub regs: (i32, i32),
}

/// Whether the kernel is enabled by default (`METRALE_CUDA_DECODE1`, default on).
pub fn enabled() -> bool {
    std::env::var("METRALE_CUDA_DECODE1")
        .map(|v| v != "0")
        .unwrap_or(true)
}

impl Decode1 {
    /// Set up the kernel for `layers` on `gpu`; `None` when the device cannot run it (too few SMs for
    /// the attention blocks, or no room for one block per SM).
    pub fn new(gpu: &Gpu, layers: &[LayerPtrs]) -> Result<Option<Decode1>, BackendError> {
        let d = gpu.dims;
        let split = std::env::var("METRALE_CUDA_DECODE1_SPLITS")
            .ok()
            .and_then(|v| {
                v.split_once(',')
                    .and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)))
            })
            .map(|(a, b): (usize, usize)| (a.clamp(1, 0xffff), b.clamp(1, MAX_SPLITS)))
            .unwrap_or(DEFAULT_SPLIT);
        let Some(blocks) = blocks(&d, gpu.sm_count) else {
            return Ok(None);
        };
        let split = fit_split(&d, blocks, split);
        let smem = smem_bytes(&d, blocks as usize);
        let Some((per_sm, regs)) = gpu.decode1_prepare(THREADS, smem)? else {
            return Ok(None);
        };
        if per_sm < 1 {
            return Ok(None);
        }
        let flags = std::env::var("METRALE_CUDA_DECODE1_FLAGS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_FLAGS);
        Ok(Some(Decode1 {
            layers: gpu.upload(layers)?,
            xch: gpu.alloc(exchange_words(&d) * 8)?,
            trace: gpu.alloc(trace_words(&d, blocks as usize) * 8)?,
            epoch: 0,
            n_layers: d.layers,
            blocks,
            smem_bytes: smem as u32,
            flags,
            split,
            regs,
        }))
    }

    /// The trace of the last launch run with flags bit 2 (see `trace_words`).
    pub fn read_trace(&self, gpu: &Gpu) -> Result<Vec<u64>, BackendError> {
        let mut t = vec![0u64; self.trace.bytes / 8];
        gpu.read(&self.trace, 0, &mut t)?;
        Ok(t)
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

    /// Enqueue one decode step (outputs in the backend's logits / out_tok / out_lp buffers).
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        emb: &DevMat,
        head: &DevMat,
        out_norm: u64,
        rope: u64,
        kc: u64,
        vc: u64,
        ctx: usize,
        s: Step,
        logits: u64,
        part: u64,
        counter: u64,
        out_tok: u64,
        out_lp: u64,
    ) -> Result<(), BackendError> {
        let epoch = self.next_epoch(gpu)?;
        let a = KArgs {
            layers: self.layers.ptr,
            emb_qs: emb.qs.ptr,
            emb_sc: emb.sc_ptr(),
            head_qs: head.qs.ptr,
            head_sc: head.sc_ptr(),
            out_norm,
            rope,
            kc,
            vc,
            token: s.token,
            pos: s.pos,
            slot: s.slot,
            ctx: ctx as i32,
            epoch,
            flags: self.flags,
            att_cfg: (self.split.0 | (self.split.1 << 16)) as i32,
            xch: self.xch.ptr,
            logits,
            part,
            counter,
            out_tok,
            out_lp,
            trace: self.trace.ptr,
        };
        gpu.decode_1(self.blocks, THREADS, self.smem_bytes, &a)
    }
}

/// `decode_1`'s arguments in order (see the template's entry point comment).
#[derive(Debug, Clone, Copy)]
pub struct KArgs {
    pub layers: u64,
    pub emb_qs: u64,
    pub emb_sc: u64,
    pub head_qs: u64,
    pub head_sc: u64,
    pub out_norm: u64,
    pub rope: u64,
    pub kc: u64,
    pub vc: u64,
    pub token: i32,
    pub pos: i32,
    pub slot: i32,
    pub ctx: i32,
    pub epoch: u32,
    pub flags: i32,
    pub att_cfg: i32,
    pub xch: u64,
    pub logits: u64,
    pub part: u64,
    pub counter: u64,
    pub out_tok: u64,
    pub out_lp: u64,
    pub trace: u64,
}

/// u64 words of the trace: `[blocks][layers][NSTAMP]` globaltimer stamps, then `[blocks][4]` (kernel
/// start, end in globaltimer ns; clock64 at start, end).
pub fn trace_words(d: &Dims, blocks: usize) -> usize {
    blocks * d.layers * NSTAMP + blocks * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> Dims {
        Dims {
            layers: 30,
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
        }
    }

    /// The layout sizes, computed by hand from the kernel's constants for SmolLM2-135M.
    #[test]
    fn layout_matches_the_kernel_for_smollm2() {
        let d = smollm();
        // X_A 576 + X_QKV (576 + 2 * 192) + X_PART 3*16*198 + X_B 576 + X_H 1536
        assert_eq!(exchange_words(&d), 576 + 960 + 9504 + 576 + 1536);
        // xr 576 + xbr 576 + vec padded(1536)=1728 + q 192 + cur 128 + rope 64 + split factors 9*16
        // + kv max(2*64*68, 3*16*198) + unit partials max(4*36, 3*36, 12*36, 3*96) at 132 blocks
        assert_eq!(
            smem_bytes(&d, 132),
            (576 + 576 + 1728 + 192 + 128 + 64 + 144 + 9504 + 432) * 4
        );
        // fewer blocks hold more units: gate/up's 1536 pairs over 24 blocks = 64 pairs of 2 x 18
        assert_eq!(
            smem_bytes(&d, 24) - smem_bytes(&d, 132),
            (64 * 36 - 432) * 4
        );
    }

    #[test]
    fn grid_is_bounded_by_the_smallest_product_and_holds_the_attention_blocks() {
        let d = smollm();
        assert_eq!(blocks(&d, 132), Some(132));
        assert_eq!(blocks(&d, 1000), Some(288)); // hidden / 2 row pairs
        assert_eq!(blocks(&d, 3), Some(3));
        assert_eq!(blocks(&d, 2), None); // not one attention block per KV head
                                         // the splits shrink to what the grid holds: 3 KV heads x 16 splits need 48 blocks
        assert_eq!(fit_split(&d, 132, (32, 16)), (32, 16));
        assert_eq!(fit_split(&d, 24, (32, 16)), (32, 8));
        assert_eq!(fit_split(&d, 3, (32, 16)), (32, 1));
        // llama-3.2-1b (8 KV heads) on an A100 (108 SMs): 13 splits, not a refusal
        let l = Dims {
            layers: 16,
            hidden: 2048,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 128256,
        };
        assert_eq!(fit_split(&l, blocks(&l, 108).unwrap(), (32, 16)), (32, 13));
    }

    #[test]
    fn splits_grow_with_length_up_to_the_cap() {
        let c = DEFAULT_SPLIT;
        assert_eq!(splits(1, c), 1);
        assert_eq!(splits(32, c), 1);
        assert_eq!(splits(33, c), 2);
        assert_eq!(splits(256, c), 8);
        assert_eq!(splits(5000, c), 16);
        assert_eq!(splits(5000, (32, 8)), 8);
        assert_eq!(splits(5000, (16, 40)), MAX_SPLITS);
    }
}
