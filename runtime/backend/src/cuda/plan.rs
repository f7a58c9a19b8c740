//! Launch planning for the CUDA backend, pure and testable without a GPU: the attention split
//! counts, every kernel's grid, the persistent decode kernel's grid and split, and the device-arch
//! check. Block sizes and the kernels' layout formulas are not here: they are the ABI's
//! (`metrale_abi`), which the kernels are compiled from.
//!
//! Invariant: nothing here touches the driver; every grid is the one the entry's declaration in
//! `metrale_abi::entries` states.

use metrale_abi::layout::{
    decode_products, q41_panel, tma_smem_bytes, tok_tile, wg_blocks_per_sm, wg_rows, wg_smem_bytes,
    wn_smem_bytes, wq_smem_bytes, WgFormat, TMA_CONFIGS, WG_TILES, WQ_TILES,
};
use metrale_abi::{
    DECODE_MAX_SPLITS, GEMM_BM, GEMM_BN, MV_THREADS, Q41_PANEL, SAMPLE_THREADS, SPLIT_THREADS,
    TMA_BK, WG_BK, WN_ROWS, WN_TOKENS, WQ_KS, WQ_ROWS,
};
use metrale_core::shape::Dims;

/// Warps per block of the matrix-vector kernels: each warp owns one row pair at a time.
pub const MV_WARPS: u32 = MV_THREADS / 32;
/// Most attention splits a per-stage `attention` launch may use (the partial buffers are sized for it).
pub const MAX_SPLITS: usize = 32;
/// Fewest positions a split should cover before splitting further stops paying.
pub const MIN_SPLIT_LEN: usize = 32;
/// Most positions a one-token step's attention covers in one split under
/// `Tuning::attention_one_split`: each warp longer over its positions and no combine, where
/// [`attention_splits`] splits from [`MIN_SPLIT_LEN`] + 1 (a batch-1 llama-bench tg128 runs at
/// positions 0..127). At Qwen3-30B-A3B's 85 positions on an H100 the attention went 6.5 -> 5.2 us
/// a layer (`bench/families/README.md`).
pub const ONE_SPLIT_LEN: usize = 128;

/// Widest hidden size (the QKV product's K) at which a one-token step's QKV product, head norms,
/// RoPE and KV write run as one launch (`attn_in_head`, a warp a row pair): each warp's chain of
/// loads and sums is a row pair of K. On an H200, Qwen3-30B-A3B (2048) gains with it
/// (`bench/families/README.md`), Qwen3-8B's q4_1 (4096) took 2,517 us a step with it and 2,375
/// with the two launches, its QKV stage alone 15.9 us against 10.4.
pub const ATTN_IN_HEAD_MAX_HIDDEN: usize = 2048;

/// Whether `attn_in_head` pays at hidden size `hidden` ([`ATTN_IN_HEAD_MAX_HIDDEN`]).
pub fn attn_in_head_pays(hidden: usize) -> bool {
    hidden <= ATTN_IN_HEAD_MAX_HIDDEN
}

/// Number of sequence splits of the split-K attention for `ntok` query tokens whose longest sequence
/// is `seq_len`, with `kv_heads` KV heads (one block per KV head, split and token) on `sm_count` SMs.
///
/// Aims at about two blocks per SM, never gives a split fewer than [`MIN_SPLIT_LEN`] positions
/// (except the single split of a short sequence), is a power of two (so a decode loop captures few
/// CUDA graphs: the count changes only at doublings) and lies in `1..=MAX_SPLITS`.
pub fn attention_splits(seq_len: usize, kv_heads: usize, ntok: usize, sm_count: usize) -> usize {
    let blocks = kv_heads.max(1) * ntok.max(1);
    let fill = (2 * sm_count.max(1)).div_ceil(blocks);
    let by_len = seq_len.max(1).div_ceil(MIN_SPLIT_LEN);
    let want = fill.min(by_len).clamp(1, MAX_SPLITS);
    // round down to a power of two
    1usize << (usize::BITS - 1 - want.leading_zeros())
}

/// The splits of a decode step's attention: one for a one-token step over at most
/// [`ONE_SPLIT_LEN`] positions where `one_split` (`Tuning::attention_one_split`), else
/// [`attention_splits`].
pub fn step_splits(
    seq_len: usize,
    kv_heads: usize,
    ntok: usize,
    sm_count: usize,
    one_split: bool,
) -> usize {
    if one_split && ntok == 1 && seq_len <= ONE_SPLIT_LEN {
        1
    } else {
        attention_splits(seq_len, kv_heads, ntok, sm_count)
    }
}

/// The query tiles of an `attention_flash` launch over a chunk: each sequence's run of consecutive
/// positions cut into pieces of at most `tok` tokens, as (first token, tokens) pairs, the pieces
/// with the latest positions (the most keys to read) first, so the longest blocks start in the
/// first wave.
pub fn flash_tiles(pos: &[i32], slot: &[i32], tok: usize) -> Vec<i32> {
    let tok = tok.max(1);
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    let mut t = 0;
    while t < pos.len() {
        let mut n = 1;
        while t + n < pos.len()
            && n < tok
            && slot[t + n] == slot[t]
            && pos[t + n] == pos[t] + n as i32
        {
            n += 1;
        }
        tiles.push((t, n));
        t += n;
    }
    tiles.sort_by_key(|&(t, n)| std::cmp::Reverse(pos[t + n - 1]));
    tiles
        .into_iter()
        .flat_map(|(t, n)| [t as i32, n as i32])
        .collect()
}

/// log2 of the (token, KV head) pairs one `attention` block serves (`abi::ATT_PACK_SHIFT`), its warps
/// shared evenly among them. A launch of one split gives each pair as many warps as one wave of
/// resident blocks (`per_sm` a SM) holds for all pairs: a pair's warps take turns over its
/// positions, so fewer warps a pair means more rounds of loads each, while warps beyond one wave
/// wait for a second. The pairs of a block are KV heads of one token, so their count divides
/// `kv_heads`. Split launches (`nsplit` > 1) keep a block a pair (0).
pub fn attention_pack(
    kv_heads: usize,
    ntok: usize,
    nsplit: usize,
    sm_count: usize,
    per_sm: usize,
) -> u32 {
    let nw = (metrale_abi::ATT_THREADS / 32) as usize;
    if nsplit != 1 {
        return 0;
    }
    let wave = sm_count.max(1) * per_sm.max(1) * nw;
    let pairs = kv_heads.max(1) * ntok.max(1);
    let mut wpp = nw;
    while wpp > 1 && pairs * wpp > wave {
        wpp /= 2;
    }
    let mut log = (nw / wpp).trailing_zeros();
    while !kv_heads.is_multiple_of(1 << log) {
        log -= 1;
    }
    log
}

/// The thread-block cluster an `attention` launch of `nsplit` splits runs as: all its splits when
/// there are at least two and at most `cluster_max` (the target's `attention_cluster`, capped by
/// the kernel's `ATT_MAX_CLUSTER`), else none (1).
pub fn attention_cluster(nsplit: usize, cluster_max: usize) -> u32 {
    let max = cluster_max.min(metrale_abi::ATT_MAX_CLUSTER as usize);
    if nsplit > 1 && nsplit <= max {
        nsplit as u32
    } else {
        1
    }
}

/// Grid of a matrix-vector kernel over `row_pairs` row pairs and `ntok` tokens of row length `k`:
/// enough blocks for every warp to own one row pair, but no more than one wave of the kernel's
/// resident blocks (`per_sm`, the driver's occupancy for its registers and shared memory; warps
/// then loop over row pairs). A second, partial wave would cost a whole block's latency again for
/// a third of the rows: q4_1 `ffn_in` at the 8B shape launched 528 blocks where 396 fit, and the
/// SMs were busy for 69% of its time.
pub fn mv_grid(
    row_pairs: usize,
    k: usize,
    ntok: usize,
    sm_count: usize,
    per_sm: usize,
) -> (u32, u32, u32) {
    let x = row_pairs
        .div_ceil(MV_WARPS as usize)
        .clamp(1, per_sm.max(1) * sm_count.max(1));
    let y = ntok.div_ceil(tok_tile(k)).max(1);
    (x as u32, y as u32, 1)
}

/// Blocks of `lm_head_1` (the one-output LM head) for a vocabulary of `vocab` rows: one wave, i.e.
/// `per_sm` resident blocks per SM (the driver's occupancy for the kernel), fewer when each warp
/// would get under 8 rows. Any count is correct (the warps stride over row batches); this only sets
/// the work per warp and the number of partials to merge.
pub fn lm_head1_blocks(vocab: usize, sm_count: usize, per_sm: usize) -> u32 {
    (per_sm.max(1) * sm_count.max(1))
        .min(vocab.div_ceil(8 * MV_WARPS as usize))
        .max(1) as u32
}

/// Grid of a tensor-core GEMM with `n` output columns over `ntok` tokens.
pub fn gemm_grid(n: usize, ntok: usize) -> (u32, u32, u32) {
    (
        (n / GEMM_BN as usize) as u32,
        ntok.div_ceil(GEMM_BM as usize).max(1) as u32,
        1,
    )
}

/// Grid of a GEMM path split kernel over `ntok` tokens (a warp per token).
pub fn split_grid(ntok: usize) -> (u32, u32, u32) {
    (
        ntok.div_ceil(SPLIT_THREADS as usize / 32).max(1) as u32,
        1,
        1,
    )
}

/// Blocks of `SAMPLE_THREADS` that spread a row of `vocab` logits one float4 per thread (the
/// kernels loop when given fewer): `mask_logits` along y, `argmax_masked_1` along x.
pub fn row_blocks(vocab: usize) -> u32 {
    (vocab / 4).div_ceil(SAMPLE_THREADS as usize).max(1) as u32
}

/// Blocks per row of `argmax_logprob` over `nout` rows of `vocab` logits on `sm_count` SMs: as
/// many as keep all rows' blocks in one wave of two `SAMPLE_THREADS` blocks an SM, at most one
/// float4 per thread of a row and at most [`ARGMAX_MAX_SPLITS`]. Measured alone on the 8B's
/// 128,256-token rows (H200, bench/gemm/README.md): 16 rows took 41.6 us one block a row and
/// 25.9 over 32 blocks (two waves), but 64 and 256 rows took longer over 17 and 5 blocks a row
/// (50.3 and 94.7 us, 4-5 waves) than one block a row (37.3 and 62.7): a wave of 1,024-thread
/// blocks costs more than their reads.
pub fn argmax_splits(nout: usize, vocab: usize, sm_count: usize) -> u32 {
    let wave = 2 * sm_count.max(1);
    (wave / nout.max(1)).clamp(1, ARGMAX_MAX_SPLITS.min(row_blocks(vocab) as usize)) as u32
}

/// Most blocks `argmax_logprob` spreads one row over ([`argmax_splits`]).
pub const ARGMAX_MAX_SPLITS: usize = 32;

/// Grid of `mask_logits` over `nout` rows of `vocab` logits.
pub fn mask_grid(nout: usize, vocab: usize) -> (u32, u32, u32) {
    (nout.max(1) as u32, row_blocks(vocab), 1)
}

/// Attention splits per KV head `decode_1` runs for a sequence of `len` positions under
/// `(split_len, max_splits)` (the kernel's `ns`).
pub fn decode1_splits(len: usize, (split_len, max_splits): (usize, usize)) -> usize {
    len.max(1)
        .div_ceil(split_len.max(1))
        .min(max_splits.min(DECODE_MAX_SPLITS as usize))
        .max(1)
}

/// Blocks of `decode_1`'s grid on a device of `sm_count` SMs: one per SM, at most the row pairs of
/// the smallest product (every block must produce in every product); `None` when the grid could not
/// hold one attention block per KV head.
pub fn decode1_blocks(d: &Dims, sm_count: usize) -> Option<u32> {
    let min_pairs = decode_products(d).iter().map(|p| p.0).min().unwrap_or(0);
    let n = sm_count.min(min_pairs);
    (n >= d.kv_heads).then_some(n as u32)
}

/// The attention split a `decode_1` grid of `blocks` blocks can run: `want`'s most splits per KV
/// head reduced so that `kv_heads * max_splits` attention blocks fit in the grid.
pub fn decode1_fit_split(d: &Dims, blocks: u32, want: (usize, usize)) -> (usize, usize) {
    (
        want.0,
        want.1
            .min(blocks as usize / d.kv_heads.max(1))
            .clamp(1, DECODE_MAX_SPLITS as usize),
    )
}

/// `decode_1`'s `att_cfg` argument for a split: `split_len | max_splits << 16`.
pub fn decode1_att_cfg((split_len, max_splits): (usize, usize)) -> i32 {
    (split_len | (max_splits << 16)) as i32
}

/// The compute capability a cubin arch such as "sm_90a" or "sm_80" runs on: (9, 0), (8, 0).
pub fn arch_capability(arch: &str) -> Option<(i32, i32)> {
    let digits: String = arch
        .strip_prefix("sm_")?
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    let n: i32 = digits.parse().ok()?;
    if n < 10 {
        return None;
    }
    Some((n / 10, n % 10))
}

/// Refuse a device whose compute capability is not the one the cubins were built for, with the
/// message users see: "built for sm_90a (h200); device 0 is sm_80 (NVIDIA A100 ...)".
pub fn check_arch(
    arch: &str,
    target: &str,
    ordinal: usize,
    device_cc: (i32, i32),
    device_name: &str,
) -> Result<(), String> {
    let want = arch_capability(arch)
        .ok_or_else(|| format!("kernel set {target}: unknown cubin arch {arch:?}"))?;
    if device_cc != want {
        let hw = target.split('/').next().unwrap_or("?");
        return Err(format!(
            "built for {arch} ({hw}); device {ordinal} is sm_{}{} ({device_name}): build the target for this GPU (cargo xtask list-targets)",
            device_cc.0, device_cc.1
        ));
    }
    Ok(())
}

/// A Hopper GEMM launch (`gemm_hopper.cu.hbs`): the token tile, grid (token tiles, row tiles,
/// K splits) and dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgPlan {
    pub tile_n: usize,
    pub grid: (u32, u32, u32),
    pub smem: u32,
}

/// Fewest pipeline stages (of `WG_BK` elements) one K split covers.
pub const WG_MIN_SPLIT_STEPS: usize = 4;

/// The Hopper GEMM launch of a product with `rows` output rows (a multiple of `WG_BM`) and row
/// length `k` over `ntok` tokens on `sm_count` SMs: the smallest token tile that holds them all
/// (128 beyond, whose blocks cover 128 rows where `rows` allows, else 64), and K split so that the
/// blocks fill the SMs ([`layout::wg_blocks_per_sm`] each) where the tiles alone are fewer (a
/// decode step of few sequences: 64 tiles for a 4096-row product).
/// `f`: the weight format (its stages, and how many blocks share an SM).
pub fn wg_plan(rows: usize, k: usize, ntok: usize, sm_count: usize, f: WgFormat) -> WgPlan {
    let fits = |t: usize| rows.is_multiple_of(wg_rows(t));
    let tile_n = WG_TILES
        .iter()
        .copied()
        .filter(|&t| fits(t))
        .find(|&t| t >= ntok)
        .unwrap_or_else(|| {
            WG_TILES
                .iter()
                .copied()
                .filter(|&t| fits(t))
                .max()
                .unwrap_or(16)
        });
    let tok_tiles = ntok.div_ceil(tile_n).max(1);
    let row_tiles = rows / wg_rows(tile_n);
    let tiles = tok_tiles * row_tiles;
    let steps = k / WG_BK as usize;
    let want = wg_blocks_per_sm(tile_n, f) * sm_count.max(1);
    let splits = (want / tiles.max(1)).clamp(1, (steps / WG_MIN_SPLIT_STEPS).max(1));
    WgPlan {
        tile_n,
        grid: (tok_tiles as u32, row_tiles as u32, splits as u32),
        smem: wg_smem_bytes(tile_n, f) as u32,
    }
}

/// The warp-specialised launch of a product of quantized weights (`wq_*`, one block per SM) with
/// `rows` output rows (a multiple of `WQ_ROWS`) and row length `k` over `ntok` tokens on
/// `sm_count` SMs: the smallest token tile that holds them all (128 beyond), and K split so that
/// the blocks fill the SMs where the tiles alone are fewer (a decode step of 16 sequences: 24
/// tiles of 256 rows for QKV), in stages of `WQ_KS * WG_BK` elements.
pub fn wq_plan(rows: usize, k: usize, ntok: usize, sm_count: usize, f: WgFormat) -> WgPlan {
    let tile_n = WQ_TILES
        .iter()
        .copied()
        .find(|&t| t >= ntok)
        .unwrap_or(WQ_TILES[WQ_TILES.len() - 1]);
    let tok_tiles = ntok.div_ceil(tile_n).max(1);
    let row_tiles = rows / WQ_ROWS as usize;
    let tiles = tok_tiles * row_tiles;
    let steps = k / (WQ_KS * WG_BK) as usize;
    let splits = (sm_count.max(1) / tiles.max(1)).clamp(1, (steps / WG_MIN_SPLIT_STEPS).max(1));
    WgPlan {
        tile_n,
        grid: (tok_tiles as u32, row_tiles as u32, splits as u32),
        smem: wq_smem_bytes(tile_n, f) as u32,
    }
}

/// Whether a product of quantized weights in format `f` over `ntok` tokens runs on the
/// warp-specialised kernels ([`wq_plan`]) rather than the one-warpgroup ones ([`wg_plan`]): q4_1
/// always; the q8_0 LM head up to 64 tokens (H200, 8B head, 2026-12-03: 231 against 260 us at 16
/// tokens, 292 against 309 at 64, but 1,022 against 685 at 256, where the one-warpgroup kernel's
/// two blocks per SM hold more stages of its 68-byte rows). Only products whose rows fill its
/// blocks (a multiple of `WQ_ROWS`): Qwen3's 151,936-row head is 593.5 of them, and its last 128
/// rows would go unwritten.
pub fn wq_pays(f: WgFormat, rows: usize, ntok: usize) -> bool {
    if !rows.is_multiple_of(WQ_ROWS as usize) {
        return false;
    }
    match f {
        WgFormat::Q4_1 => true,
        WgFormat::Q8_0 => ntok <= 64,
        WgFormat::Bf16 => false,
    }
}

/// Blocks per SM a narrow GEMM launch plans for (its `__launch_bounds__`: registers for two).
pub const WN_BLOCKS_PER_SM: usize = 2;

/// Fewest q4_1 panels of K one split of a narrow GEMM covers: below it the combine of the
/// splits' partial tiles costs more than the rows' share of the copy.
pub const WN_MIN_SPLIT_PANELS: usize = 4;

/// Whether a product of `rows` rows of length `k` in format `f` over `ntok` tokens runs on the
/// narrow GEMMs (`wn_*`, [`wn_plan`]): q4_1 weights in panels of [`Q41_PANEL`] blocks, whole
/// blocks of [`WN_ROWS`] rows, at most [`WN_TOKENS`] tokens.
pub fn wn_pays(f: WgFormat, rows: usize, k: usize, ntok: usize) -> bool {
    f == WgFormat::Q4_1
        && (1..=WN_TOKENS as usize).contains(&ntok)
        && rows.is_multiple_of(WN_ROWS as usize)
        && q41_panel(k) == Q41_PANEL as usize
}

/// The narrow GEMM launch of a product with `rows` output rows (a multiple of `WN_ROWS`) and row
/// length `k` on `sm_count` SMs: a block per `WN_ROWS` rows, K split in whole panels so that
/// [`WN_BLOCKS_PER_SM`] blocks an SM fill the GPU once (each split at least
/// [`WN_MIN_SPLIT_PANELS`] panels), the dynamic shared memory of the largest split's activations.
pub fn wn_plan(rows: usize, k: usize, sm_count: usize) -> WgPlan {
    let row_tiles = rows / WN_ROWS as usize;
    let panels = k / (32 * Q41_PANEL as usize);
    let want = WN_BLOCKS_PER_SM * sm_count.max(1);
    let splits = (want / row_tiles.max(1)).clamp(1, (panels / WN_MIN_SPLIT_PANELS).max(1));
    WgPlan {
        tile_n: WN_TOKENS as usize,
        grid: (1, row_tiles as u32, splits as u32),
        smem: wn_smem_bytes(panels.div_ceil(splits)) as u32,
    }
}

/// Bytes of the split-K partials and of the tickets any [`wg_plan`] or [`wq_plan`] launch on
/// `sm_count` SMs uses: a launch splits only while its tiles times splits fill the SMs at most
/// once, and each split's partial is one block's output tile in f32.
pub fn wg_scratch_bytes(sm_count: usize) -> (usize, usize) {
    let (mut ws, mut tickets) = (0, 0);
    for n in WG_TILES {
        for f in [WgFormat::Bf16, WgFormat::Q4_1] {
            let blocks = wg_blocks_per_sm(n, f) * sm_count.max(1);
            ws = ws.max(blocks * wg_rows(n) * n * 4);
            tickets = tickets.max(blocks * 4);
        }
    }
    for n in WQ_TILES {
        ws = ws.max(sm_count.max(1) * WQ_ROWS as usize * n * 4);
        tickets = tickets.max(sm_count.max(1) * 4);
    }
    // wn_plan: its blocks are at most WN_BLOCKS_PER_SM an SM where it splits
    let wn_blocks = WN_BLOCKS_PER_SM * sm_count.max(1);
    ws = ws.max(wn_blocks * WN_ROWS as usize * WN_TOKENS as usize * 4);
    tickets = tickets.max(wn_blocks * 4);
    (ws, tickets)
}

/// A warp-specialised Hopper GEMM launch (`gemm_tma.cu.hbs`): the block tile (an index into
/// `layout::TMA_CONFIGS`), K splits, blocks (each loops over its units) and dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmaPlan {
    pub cfg: usize,
    pub splits: usize,
    pub blocks: u32,
    pub smem: u32,
}

/// Fewest pipeline stages (of `TMA_BK` elements) one K split of a warp-specialised GEMM covers.
pub const TMA_MIN_SPLIT_STEPS: usize = 4;

/// What [`tma_estimate`] prices a launch at, fitted to the sweep of every tile and split over the
/// 8B shape's products at 16-4,096 tokens on the H200 (bench/gemm/README.md, 2026-12-03: the
/// launch it picks is on average 1.5% slower than the fastest one measured): a block's sustained
/// MMA rate on the wide tiles, the memory rate and the share of SMs that reaches it, a fixed cost
/// per wave of units (pipeline fill, epilogue) and per K split (the tickets, the last split's
/// combine), and the rate the split partials cross L2 at. Estimates only rank launches of one
/// product.
const TMA_SM_FLOPS: f64 = 5.2e12;
const TMA_BYTES_PER_S: f64 = 4.2e12;
const TMA_STREAMING_SMS: f64 = 0.9;
const TMA_WAVE_S: f64 = 2.0e-6;
const TMA_SPLIT_S: f64 = 2.0e-6;
const TMA_PARTIAL_BYTES_PER_S: f64 = 2.0e12;

/// A tile's MMA rate relative to the wide 128-token tiles (measured: 128 x 128 reads more operand
/// bytes per MMA from shared memory; 64-token tiles reuse each weight stage for half as many
/// tokens; the QKV product at 256 tokens took 27-29 us on 128 x 96 against 28 on 128 x 128, so
/// the 128 x 96 tile is priced to lose there).
fn tma_efficiency(bm: usize, bn: usize) -> f64 {
    match (bm, bn) {
        (128, 128) => 0.85,
        (128, 96) => 0.6,
        (128, _) => 1.0,
        (64, 96) => 0.6,
        _ => 0.7,
    }
}

/// Estimated seconds of a warp-specialised GEMM of `rows` x `k` over `ntok` tokens with tile
/// `cfg` and `splits` K splits on `sm_count` SMs: the larger of its waves of units (MMA time and
/// fixed cost each) and the weights' bytes at the memory rate over the blocks that stream them,
/// plus the K splits' fixed cost and partials.
pub fn tma_estimate(
    rows: usize,
    k: usize,
    ntok: usize,
    cfg: usize,
    splits: usize,
    sm_count: usize,
) -> f64 {
    let (bm, bn) = TMA_CONFIGS[cfg];
    let sms = sm_count.max(1);
    let nk = k / TMA_BK as usize;
    let tiles = ntok.div_ceil(bm) * (rows / bn);
    let units = tiles * splits;
    let blocks = units.min(sms);
    let waves = units.div_ceil(blocks) as f64;
    let unit_flops = (bm * bn * nk.div_ceil(splits) * TMA_BK as usize * 2) as f64;
    let compute = waves * (unit_flops / (TMA_SM_FLOPS * tma_efficiency(bm, bn)) + TMA_WAVE_S);
    let share = (blocks as f64 / (TMA_STREAMING_SMS * sms as f64)).min(1.0);
    let memory = (rows * k * 2) as f64 / (TMA_BYTES_PER_S * share);
    let partials = if splits > 1 {
        TMA_SPLIT_S + (tiles * splits * bm.min(ntok) * bn * 4 * 2) as f64 / TMA_PARTIAL_BYTES_PER_S
    } else {
        0.0
    };
    compute.max(memory) + partials
}

/// The warp-specialised GEMM launch of a product with `rows` output rows and row length `k` over
/// `ntok` tokens on `sm_count` SMs (`residual`: the O or down product, whose epilogue may write the
/// next product's input, [`tma_norm_out`]; `narrow`: the 96-row tiles allowed): of the tiles whose
/// weight-row width divides `rows`, and K splits that keep every unit in one wave (the split
/// partials live in [`tma_scratch_bytes`]), the one [`tma_estimate`] prices lowest; `None` when no
/// tile divides `rows` or `k` is not a multiple of `TMA_BK`.
pub fn tma_plan(
    rows: usize,
    k: usize,
    ntok: usize,
    sm_count: usize,
    residual: bool,
    narrow: bool,
) -> Option<TmaPlan> {
    let nk = k / TMA_BK as usize;
    let mut best: Option<(f64, TmaPlan)> = None;
    for cfg in (0..TMA_CONFIGS.len()).filter(|&c| narrow || TMA_CONFIGS[c].1 > 96) {
        for splits in 1..=(nk / TMA_MIN_SPLIT_STEPS).max(1) {
            let Some(l) = tma_launch(rows, k, ntok, cfg, splits, sm_count, residual) else {
                continue;
            };
            let est = tma_estimate(rows, k, ntok, cfg, splits, sm_count);
            if best.is_none_or(|(b, _)| est < b) {
                best = Some((est, l));
            }
        }
    }
    best.map(|(_, p)| p)
}

/// The launch of tile `cfg` with `splits` K splits (what [`tma_plan`] returns for its choice; the
/// benchmarks' sweep and the tests force others): one block per unit, at most one per SM. `None`
/// where the split partials would not fit [`tma_scratch_bytes`] (a split launch's units must fit
/// one wave), a split would cover fewer than [`TMA_MIN_SPLIT_STEPS`] stages, or the product is a
/// `residual` one and the tile cannot write the next product's input.
pub fn tma_launch(
    rows: usize,
    k: usize,
    ntok: usize,
    cfg: usize,
    splits: usize,
    sm_count: usize,
    residual: bool,
) -> Option<TmaPlan> {
    let (bm, bn) = *TMA_CONFIGS.get(cfg)?;
    let sms = sm_count.max(1);
    if ntok == 0
        || splits == 0
        || !rows.is_multiple_of(bn)
        || !k.is_multiple_of(TMA_BK as usize)
        || (residual && !tma_norm_out(cfg))
    {
        return None;
    }
    let tiles = ntok.div_ceil(bm) * (rows / bn);
    if splits > 1 && (tiles * splits > sms || k / TMA_BK as usize / splits < TMA_MIN_SPLIT_STEPS) {
        return None;
    }
    Some(TmaPlan {
        cfg,
        splits,
        blocks: (tiles * splits).min(sms) as u32,
        smem: tma_smem_bytes(cfg) as u32,
    })
}

/// Whether tile `cfg` gives each consumer warpgroup whole groups of `abi::SS_COLS` columns, whose
/// squares the O and down epilogues sum when they write the next product's input (`tma::gemm`
/// asserts it; 64 x 96 leaves each warpgroup 48 rows).
pub fn tma_norm_out(cfg: usize) -> bool {
    let (bm, bn) = TMA_CONFIGS[cfg];
    let wn = if bm == 128 { bn } else { bn / 2 };
    wn.is_multiple_of(metrale_abi::SS_COLS as usize)
}

/// Bytes of the split partials and of the tickets any [`tma_plan`] launch on `sm_count` SMs uses:
/// it splits only while its units fit one wave, each split's partial one block tile in f32.
pub fn tma_scratch_bytes(sm_count: usize) -> (usize, usize) {
    let tile = TMA_CONFIGS.iter().map(|&(m, n)| m * n).max().unwrap_or(0);
    (sm_count.max(1) * tile * 4, sm_count.max(1) * 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `attn_in_head` up to Qwen3-30B-A3B's hidden 2048, where it was measured to pay (smaller
    /// ones, as Qwen3-0.6B's 1024, keep it unmeasured); not Qwen2.5-7B's 3584 nor Qwen3-8B's 4096.
    #[test]
    fn attn_in_head_pays_up_to_2048() {
        assert!(attn_in_head_pays(1024));
        assert!(attn_in_head_pays(2048));
        assert!(!attn_in_head_pays(3584));
        assert!(!attn_in_head_pays(4096));
    }

    #[test]
    fn splits_are_powers_of_two_within_bounds() {
        for seq in [1usize, 2, 31, 32, 33, 64, 100, 1000, 8192, 1 << 20] {
            for kv in [1usize, 3, 8] {
                for ntok in [1usize, 2, 8, 64, 512] {
                    for sm in [108usize, 132, 142] {
                        let s = attention_splits(seq, kv, ntok, sm);
                        assert!(
                            s.is_power_of_two() && (1..=MAX_SPLITS).contains(&s),
                            "{seq} {kv} {ntok} {sm} -> {s}"
                        );
                        // no split shorter than MIN_SPLIT_LEN unless there is only one
                        assert!(
                            s == 1 || seq.div_ceil(s) >= MIN_SPLIT_LEN / 2,
                            "{seq} {kv} {ntok} {sm} -> {s}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn attention_packs_pairs_into_one_wave() {
        // the 8B shape on an H200: 8 KV heads, 132 SMs, 2 resident blocks of 8 warps (2,112 warps)
        assert_eq!(attention_pack(8, 256, 1, 132, 2), 3); // 2,048 pairs: a warp each
        assert_eq!(attention_pack(8, 128, 1, 132, 2), 2); // 1,024: two warps each
        assert_eq!(attention_pack(8, 64, 1, 132, 2), 1); // 512: four
        assert_eq!(attention_pack(8, 16, 1, 132, 2), 0); // 128: all eight
        assert_eq!(attention_pack(8, 256, 2, 132, 2), 0); // splits: a block a pair
                                                          // SmolLM2's 3 KV heads: pairs of a block are one token's KV heads, so never more than one
        assert_eq!(attention_pack(3, 512, 1, 132, 2), 0);
        // Llama-3.2-1B's 8 at 1,024 tokens: a warp a pair, the rest in further waves
        assert_eq!(attention_pack(8, 1024, 1, 132, 2), 3);
        for kv in [1usize, 2, 3, 4, 8, 12] {
            for ntok in [1usize, 7, 64, 300, 4096] {
                let p = attention_pack(kv, ntok, 1, 132, 2);
                assert!(p <= 3 && kv % (1 << p) == 0, "{kv} {ntok} -> {p}");
            }
        }
    }

    #[test]
    fn flash_tiles_cut_runs_and_put_the_longest_first() {
        // slot 0 continues at 40 (37 tokens), slot 1 starts (5), slot 2 decodes one token at 900
        let mut pos: Vec<i32> = (40..77).collect();
        let mut slot = vec![0; 37];
        pos.extend(0..5);
        slot.extend([1; 5]);
        pos.push(900);
        slot.push(2);
        let tiles = flash_tiles(&pos, &slot, 16);
        let pairs: Vec<(i32, i32)> = tiles.chunks(2).map(|c| (c[0], c[1])).collect();
        assert_eq!(pairs, [(42, 1), (32, 5), (16, 16), (0, 16), (37, 5)]);
        // every token in exactly one tile, each tile one sequence at consecutive positions
        let mut seen = vec![0; pos.len()];
        for &(t0, n) in &pairs {
            for t in t0..t0 + n {
                seen[t as usize] += 1;
                assert_eq!(slot[t as usize], slot[t0 as usize]);
                assert_eq!(pos[t as usize], pos[t0 as usize] + t - t0);
            }
        }
        assert!(seen.iter().all(|&k| k == 1));
        // a run that breaks its positions (same slot) starts a new tile
        assert_eq!(flash_tiles(&[3, 4, 9], &[0, 0, 0], 16), [2, 1, 0, 2]);
    }

    #[test]
    fn splits_grow_with_length_and_shrink_with_batch() {
        // SmolLM2 on an H200: 3 KV heads, 132 SMs
        assert_eq!(attention_splits(10, 3, 1, 132), 1);
        assert_eq!(attention_splits(64, 3, 1, 132), 2);
        assert_eq!(attention_splits(200, 3, 1, 132), 4);
        assert_eq!(attention_splits(4096, 3, 1, 132), 32);
        assert_eq!(attention_splits(4096, 3, 64, 132), 2);
        assert_eq!(attention_splits(4096, 3, 512, 132), 1);
        assert_eq!(attention_splits(4096, 3, 8, 132), 8);
        let mut last = 0;
        for seq in 1..5000 {
            let s = attention_splits(seq, 3, 1, 132);
            assert!(s >= last);
            last = s;
        }
        // Qwen3-30B-A3B's 4 KV heads, one token, 85 positions: 2 splits of 43 by the rule
        assert_eq!(attention_splits(85, 4, 1, 132), 2);
        // one split: a one-token step up to 128 positions, then the rule above; steps of
        // several tokens always by the rule
        assert_eq!(step_splits(85, 4, 1, 132, true), 1);
        assert_eq!(step_splits(128, 4, 1, 132, true), 1);
        assert_eq!(step_splits(129, 4, 1, 132, true), 4);
        assert_eq!(step_splits(4096, 4, 1, 132, true), 32);
        assert_eq!(step_splits(85, 4, 16, 132, true), 2);
        assert_eq!(step_splits(85, 4, 1, 132, false), 2);
    }

    #[test]
    fn arch_mismatch_is_refused_with_both_archs() {
        assert!(check_arch("sm_90a", "h200/smollm2-135m/q4_1", 0, (9, 0), "NVIDIA H200").is_ok());
        let e = check_arch(
            "sm_90a",
            "h200/smollm2-135m/q4_1",
            0,
            (8, 0),
            "NVIDIA A100-SXM4-80GB",
        )
        .unwrap_err();
        assert!(
            e.starts_with("built for sm_90a (h200); device 0 is sm_80 (NVIDIA A100-SXM4-80GB)"),
            "{e}"
        );
        assert!(check_arch("sm_89", "l40s/x/y", 1, (9, 0), "H100")
            .unwrap_err()
            .contains("device 1 is sm_90"));
    }

    #[test]
    fn arch_parse() {
        assert_eq!(arch_capability("sm_90a"), Some((9, 0)));
        assert_eq!(arch_capability("sm_80"), Some((8, 0)));
        assert_eq!(arch_capability("sm_89"), Some((8, 9)));
        assert_eq!(arch_capability("compute_90"), None);
        assert_eq!(arch_capability("sm_"), None);
    }

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

    #[test]
    fn decode1_grid_is_bounded_by_the_smallest_product_and_holds_the_attention_blocks() {
        let d = smollm();
        assert_eq!(decode1_blocks(&d, 132), Some(132));
        assert_eq!(decode1_blocks(&d, 1000), Some(288)); // hidden / 2 row pairs
        assert_eq!(decode1_blocks(&d, 3), Some(3));
        assert_eq!(decode1_blocks(&d, 2), None); // not one attention block per KV head
                                                 // the splits shrink to what the grid holds: 3 KV heads x 16 splits need 48 blocks
        assert_eq!(decode1_fit_split(&d, 132, (32, 16)), (32, 16));
        assert_eq!(decode1_fit_split(&d, 24, (32, 16)), (32, 8));
        assert_eq!(decode1_fit_split(&d, 3, (32, 16)), (32, 1));
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
        assert_eq!(
            decode1_fit_split(&l, decode1_blocks(&l, 108).unwrap(), (32, 16)),
            (32, 13)
        );
        assert_eq!(decode1_att_cfg((32, 16)), 32 | (16 << 16));
    }

    #[test]
    fn decode1_splits_grow_with_length_up_to_the_cap() {
        let c = (32, 16);
        assert_eq!(decode1_splits(1, c), 1);
        assert_eq!(decode1_splits(32, c), 1);
        assert_eq!(decode1_splits(33, c), 2);
        assert_eq!(decode1_splits(256, c), 8);
        assert_eq!(decode1_splits(5000, c), 16);
        assert_eq!(decode1_splits(5000, (32, 8)), 8);
        assert_eq!(decode1_splits(5000, (16, 40)), DECODE_MAX_SPLITS as usize);
    }

    #[test]
    fn grids_cover_every_token_and_column() {
        assert_eq!(gemm_grid(576, 512), (9, 16, 1));
        assert_eq!(gemm_grid(960, 77), (15, 3, 1));
        assert_eq!(gemm_grid(3072, 16), (48, 1, 1));
        assert_eq!(gemm_grid(3072, 1), (48, 1, 1));
        assert_eq!(split_grid(17), (3, 1, 1));
        assert_eq!(mv_grid(1536, 576, 9, 132, 4), (192, 2, 1));
        // one wave of resident blocks at most: 14336 row pairs, 3 blocks per SM
        assert_eq!(mv_grid(14336, 4096, 1, 132, 3), (396, 1, 1));
        assert_eq!(mv_grid(14336, 4096, 1, 132, 0), (132, 1, 1));
        assert_eq!(attention_cluster(4, 4), 4);
        assert_eq!(attention_cluster(8, 4), 1);
        assert_eq!(attention_cluster(1, 4), 1);
        assert_eq!(attention_cluster(8, 16), 8);
        assert_eq!(attention_cluster(2, 0), 1);
    }

    #[test]
    fn wg_plans_split_narrow_products_and_stay_in_the_scratch() {
        // 8B, 16 sequences: one 16-token tile; the 4096-row output projection splits K in 4
        let p = wg_plan(4096, 4096, 16, 132, WgFormat::Bf16);
        assert_eq!((p.tile_n, p.grid), (16, (1, 64, 4)));
        // the down projection (K = 14336) likewise; gate/up (448 tiles) does not split
        assert_eq!(
            wg_plan(4096, 14336, 16, 132, WgFormat::Bf16).grid,
            (1, 64, 4)
        );
        assert_eq!(
            wg_plan(28672, 4096, 16, 132, WgFormat::Bf16).grid,
            (1, 448, 1)
        );
        // 256 sequences: two 128-token tiles of 128-row blocks, one block per SM
        assert_eq!(
            wg_plan(4096, 4096, 256, 132, WgFormat::Bf16).grid,
            (2, 32, 2)
        );
        assert_eq!(
            wg_plan(28672, 4096, 512, 132, WgFormat::Bf16).grid,
            (4, 224, 1)
        );
        // rows that 128-row blocks do not divide keep 64-row blocks and 64-token tiles
        assert_eq!(wg_plan(960, 576, 256, 132, WgFormat::Bf16).tile_n, 64);
        assert_eq!(wg_plan(6144, 4096, 77, 132, WgFormat::Bf16).tile_n, 128);
        assert_eq!(wg_plan(6144, 4096, 33, 132, WgFormat::Bf16).tile_n, 64);
        // SmolLM2-sized K: never fewer than 4 stages per split
        assert_eq!(wg_plan(576, 576, 16, 132, WgFormat::Bf16).grid.2, 2);
        // q4_1: two blocks per SM at 128 tokens too, so 256 sequences split the output
        // projection's 64 tiles in 4 (bf16: 2)
        assert_eq!(
            wg_plan(4096, 4096, 256, 132, WgFormat::Q4_1).grid,
            (2, 32, 4)
        );
        let (ws, cnt) = wg_scratch_bytes(132);
        for (rows, k) in [
            (6144, 4096),
            (4096, 4096),
            (28672, 4096),
            (4096, 14336),
            (576, 576),
        ] {
            for ntok in 1..=600 {
                let f = if ntok % 2 == 0 {
                    WgFormat::Bf16
                } else {
                    WgFormat::Q4_1
                };
                let p = wg_plan(rows, k, ntok, 132, f);
                let tiles = (p.grid.0 * p.grid.1) as usize;
                if p.grid.2 > 1 {
                    assert!(tiles * p.grid.2 as usize * wg_rows(p.tile_n) * p.tile_n * 4 <= ws);
                    assert!(tiles * 4 <= cnt);
                }
                assert!(p.tile_n * p.grid.0 as usize >= ntok);
                if rows.is_multiple_of(256) {
                    let q = wq_plan(rows, k, ntok, 132, WgFormat::Q4_1);
                    let tiles = (q.grid.0 * q.grid.1) as usize;
                    assert_eq!(q.grid.1 as usize * WQ_ROWS as usize, rows);
                    if q.grid.2 > 1 {
                        assert!(tiles * q.grid.2 as usize <= 132);
                        assert!(tiles * q.grid.2 as usize * WQ_ROWS as usize * q.tile_n * 4 <= ws);
                        assert!(tiles * 4 <= cnt);
                    }
                    assert!(q.tile_n * q.grid.0 as usize >= ntok);
                }
            }
        }
    }

    #[test]
    fn wn_plans_fill_two_blocks_an_sm_and_fit_their_scratch() {
        // 8B q4_1 at 132 SMs: QKV's 48 tiles of 128 rows split K in 5 (240 blocks, 6-7 panels a
        // split), O's and down's 32 in 8, gate/up's 224 not at all (its whole row: 64 KiB)
        let qkv = wn_plan(6144, 4096, 132);
        assert_eq!((qkv.grid, qkv.smem), ((1, 48, 5), 7 * 2048));
        assert_eq!(wn_plan(4096, 4096, 132).grid, (1, 32, 8));
        let gu = wn_plan(28672, 4096, 132);
        assert_eq!((gu.grid, gu.smem), ((1, 224, 1), 32 * 2048));
        let down = wn_plan(4096, 14336, 132);
        assert_eq!((down.grid, down.smem), ((1, 32, 8), 14 * 2048));
        let (ws, cnt) = wg_scratch_bytes(132);
        for (rows, k) in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] {
            assert!(wn_pays(WgFormat::Q4_1, rows, k, 5));
            let p = wn_plan(rows, k, 132);
            let blocks = (p.grid.1 * p.grid.2) as usize;
            assert!(blocks <= WN_BLOCKS_PER_SM * 132);
            assert!(blocks * WN_ROWS as usize * WN_TOKENS as usize * 4 <= ws);
            assert!(p.grid.1 as usize * 4 <= cnt);
            assert!(p.smem as usize <= 113 * 1024, "two blocks an SM");
        }
        // not the formats, token counts or shapes it is not made for: bf16, 9 tokens, SmolLM2's
        // 960-row QKV and 576-wide rows (one panel a row)
        assert!(!wn_pays(WgFormat::Bf16, 4096, 4096, 5));
        assert!(!wn_pays(WgFormat::Q4_1, 4096, 4096, 9));
        assert!(!wn_pays(WgFormat::Q4_1, 4096, 4096, 0));
        assert!(!wn_pays(WgFormat::Q4_1, 960, 576, 5));
        assert!(!wn_pays(WgFormat::Q4_1, 1536, 576, 5));
    }

    #[test]
    fn wq_plans_fill_the_sms_with_one_block_each() {
        // 8B q4_1, 16 sequences: QKV's 24 tiles of 256 rows split K in 5 (120 blocks); gate/up's
        // 112 tiles do not split
        let p = wq_plan(6144, 4096, 16, 132, WgFormat::Q4_1);
        assert_eq!((p.tile_n, p.grid), (16, (1, 24, 5)));
        assert_eq!(
            wq_plan(28672, 4096, 16, 132, WgFormat::Q4_1).grid,
            (1, 112, 1)
        );
        // 256 sequences: two 128-token tiles; 4,096 tokens: 32 of them
        assert_eq!(
            wq_plan(4096, 4096, 256, 132, WgFormat::Q4_1).grid,
            (2, 16, 4)
        );
        assert_eq!(
            wq_plan(28672, 4096, 4096, 132, WgFormat::Q4_1).grid,
            (32, 112, 1)
        );
        assert_eq!(wq_plan(6144, 4096, 100, 132, WgFormat::Q4_1).tile_n, 128);
        // the down projection (K = 14336: 112 stages of 128) at 16 tokens: 16 tiles, 8 splits
        assert_eq!(
            wq_plan(4096, 14336, 16, 132, WgFormat::Q4_1).grid,
            (1, 16, 8)
        );
        assert_eq!(
            wq_plan(6144, 4096, 16, 132, WgFormat::Q8_0).smem as usize,
            wq_smem_bytes(16, WgFormat::Q8_0)
        );
        // a head whose rows do not fill 256-row blocks (Qwen3's 151,936) stays on wg_plan's
        // 64-row blocks (the H200's kernel test left its last 128 rows unwritten otherwise)
        assert!(wq_pays(WgFormat::Q8_0, 128256, 5));
        assert!(!wq_pays(WgFormat::Q8_0, 151936, 5));
        let p = wg_plan(151936, 4096, 5, 132, WgFormat::Q8_0);
        assert_eq!(p.grid.1 as usize * wg_rows(p.tile_n), 151936);
    }

    #[test]
    fn tma_plans_fill_the_sms_and_stay_in_the_scratch() {
        let (ws, cnt) = tma_scratch_bytes(132);
        // the 8B shape's products, and SmolLM2's and Llama-3.2-1B's
        for (rows, k) in [
            (6144, 4096),
            (4096, 4096),
            (28672, 4096),
            (4096, 14336),
            (128256, 4096),
            (960, 576),
            (576, 576),
            (3072, 576),
            (576, 1536),
            (3072, 2048),
            (16384, 2048),
        ] {
            for ntok in [1, 2, 16, 29, 64, 77, 128, 160, 256, 300, 512, 4096] {
                let p = tma_plan(rows, k, ntok, 132, false, true)
                    .expect("a tile divides every shape here");
                let (bm, bn) = TMA_CONFIGS[p.cfg];
                assert!(rows.is_multiple_of(bn));
                let tiles = ntok.div_ceil(bm) * (rows / bn);
                assert!(p.blocks as usize <= 132 && p.blocks as usize <= tiles * p.splits);
                if p.splits > 1 {
                    assert!(tiles * p.splits <= 132, "{rows} {k} {ntok}: {p:?}");
                    assert!(tiles * p.splits * bm * bn * 4 <= ws && tiles * 4 <= cnt);
                    assert!(k / 64 / p.splits >= TMA_MIN_SPLIT_STEPS);
                }
            }
        }
        // no tile divides 100 rows; K must be whole stages
        assert!(tma_plan(100, 4096, 256, 132, false, true).is_none());
        assert!(tma_plan(4096, 4000, 256, 132, false, true).is_none());
        // 256 tokens: the 8B's narrow products still fill most SMs (smaller tiles or K splits)
        for (rows, k) in [(4096, 4096), (6144, 4096), (4096, 14336)] {
            let p = tma_plan(rows, k, 256, 132, false, true).unwrap();
            assert!(p.blocks >= 96, "{rows} x {k}: {p:?}");
        }
        assert_eq!(
            tma_plan(28672, 4096, 4096, 132, false, true)
                .unwrap()
                .splits,
            1
        );
        // a residual product (O, down) never takes a tile that splits a 32-column group
        for ntok in [32, 64, 77, 128, 256] {
            for rows in [576, 4096] {
                let p = tma_plan(rows, 4096, ntok, 132, true, true).unwrap();
                assert!(tma_norm_out(p.cfg), "{rows} rows, {ntok} tokens: {p:?}");
            }
        }
        assert!(!tma_norm_out(7) && tma_norm_out(6));
    }

    #[test]
    fn argmax_rows_fill_one_wave() {
        let v = 128_256;
        for (nout, want) in [
            (1, 32),
            (16, 16),
            (40, 6),
            (64, 4),
            (128, 2),
            (256, 1),
            (4096, 1),
        ] {
            assert_eq!(argmax_splits(nout, v, 132), want, "{nout} rows");
        }
        // a small vocabulary: at most one float4 per thread of a row
        assert_eq!(argmax_splits(1, 8192, 132), 2);
    }
}
