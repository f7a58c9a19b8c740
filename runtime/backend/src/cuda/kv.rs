//! The paged KV cache on the device: one pool for K and one for V, laid out
//! `[block][layer][kv_head][KV_BLOCK][head_dim]` in the target's KV type (`[quant] kv`: f32, bf16,
//! or fp8 with each (block, layer, KV head)'s KV_BLOCK f32 scales after its vectors),
//! and the block tables `[slots][max_blocks]` (u32) through which every kernel finds a position
//! (`mt::kv_off` in kernels/cuda/common.cuh). A host mirror of the tables lets a step upload only
//! the entries that changed (a decode step adds at most one block per sequence).
//!
//! Invariants: entries of a table row past what the last step gave are stale and never read (a step
//! reads positions below `start_pos + tokens`, which its table covers: `validate_batch`); the pool
//! is allocated once, in `CudaBackend::new`.

use metrale_core::shape::{Dims, KvDtype, KV_BLOCK};
use metrale_core::BackendError;

use super::device::DevBuf;
use super::launch::Gpu;

/// The pool and the tables (see the module docs).
pub struct KvCache {
    pub kc: DevBuf,
    pub vc: DevBuf,
    pub tables: DevBuf,
    pub blocks: usize,
    /// Entries per table row: the blocks of one sequence at full context.
    pub max_blocks: usize,
    pub dtype: KvDtype,
    host: Vec<u32>,
}

/// Device bytes of one block (K and V, every layer): an fp8 cache's scales included, one f32 a
/// head vector (`mt::kv_seg`: a (block, layer, KV head) segment is its KV_BLOCK vectors, then
/// their scales).
pub fn block_bytes(d: &Dims, dtype: KvDtype) -> usize {
    2 * d.layers * d.kv_heads * metrale_abi::layout::kv_seg(d, dtype) * dtype.bytes()
}

/// The pool's size: `requested` blocks if nonzero; else every slot at full context
/// (`slots x max_blocks`) or, when that does not fit, what fits in `fraction` of the device's memory
/// once what is already allocated (weights, buffers) is counted, less a 512 MiB margin (graphs,
/// the driver's own). Refused when not even one sequence of full context fits.
pub fn pool_blocks(
    gpu: &Gpu,
    d: &Dims,
    dtype: KvDtype,
    (slots, max_blocks): (usize, usize),
    requested: usize,
    fraction: f64,
) -> Result<usize, BackendError> {
    let per = block_bytes(d, dtype);
    let (free, total) = gpu.mem_info();
    let used = total.saturating_sub(free);
    let budget = ((total as f64 * fraction) as usize)
        .saturating_sub(used)
        .saturating_sub(512 << 20)
        .min(free);
    let blocks = if requested > 0 {
        requested
    } else {
        (budget / per.max(1)).min(slots.saturating_mul(max_blocks))
    };
    if blocks < max_blocks || blocks.saturating_mul(per) > free {
        return Err(BackendError::OutOfMemory {
            device: gpu.name.clone(),
            needed: (blocks.max(max_blocks) * per) as u64,
            free: free as u64,
            hint: format!(
                "a KV pool of {} blocks of {KV_BLOCK} tokens ({} {dtype} bytes each) must hold one sequence of the \
                 context ({} tokens) and fit in the memory left after the weights ({budget} bytes within the \
                 memory fraction {fraction}); lower the context size or --kv-cache-tokens, or raise \
                 --gpu-memory-utilization",
                blocks.max(max_blocks),
                per,
                max_blocks * KV_BLOCK
            ),
        });
    }
    Ok(blocks)
}

impl KvCache {
    pub fn new(
        gpu: &Gpu,
        dtype: KvDtype,
        blocks: usize,
        (slots, max_blocks): (usize, usize),
    ) -> Result<KvCache, BackendError> {
        let half = block_bytes(&gpu.dims, dtype) / 2 * blocks;
        Ok(KvCache {
            kc: gpu.alloc(half)?,
            vc: gpu.alloc(half)?,
            tables: gpu.alloc(slots * max_blocks * 4)?,
            blocks,
            max_blocks,
            dtype,
            host: vec![u32::MAX; slots * max_blocks],
        })
    }

    /// Bytes of the pool (K and V).
    pub fn bytes(&self) -> u64 {
        (self.kc.bytes + self.vc.bytes) as u64
    }

    /// Make `slot`'s device table row start with `blocks` (at most `max_blocks` of them), uploading
    /// the entries that differ from what the row holds, in stream order.
    pub fn sync(&mut self, gpu: &Gpu, slot: usize, blocks: &[u32]) -> Result<(), BackendError> {
        let n = blocks.len().min(self.max_blocks);
        let row = &mut self.host[slot * self.max_blocks..][..n];
        let Some(first) = row.iter().zip(blocks).position(|(a, b)| a != b) else {
            return Ok(());
        };
        row[first..].copy_from_slice(&blocks[first..n]);
        gpu.write_async(
            &self.tables,
            (slot * self.max_blocks + first) * 4,
            &blocks[first..n],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fp8_block_holds_its_vectors_and_their_scales() {
        // the 8B shape: 32 layers, 8 KV heads of 128
        let d = Dims {
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            vocab: 128256,
        };
        assert_eq!(block_bytes(&d, KvDtype::Bf16), 2 * 32 * 8 * 16 * 128 * 2);
        // each (block, layer, KV head) segment: 16 vectors of 128 bytes, then 16 f32 scales
        // (kernels/cuda/common.cuh, mt::kv_seg)
        assert_eq!(
            block_bytes(&d, KvDtype::Fp8),
            2 * 32 * 8 * (16 * 128 + 16 * 4)
        );
        assert_eq!(
            block_bytes(&d, KvDtype::F32),
            2 * block_bytes(&d, KvDtype::Bf16)
        );
    }
}
