//! Layout formulas of the kernels' memory, as the host sizes buffers and grids by them, and the
//! `static_assert`s that tie each to the kernel's own formula for one target.
//!
//! A kernel keeps the `constexpr` formula it indexes with (`mt::TokTile<K>::N`, `decode_1`'s
//! `S_PART`, ...); the host computes the same number here. [`asserts`] renders, for one template and
//! one target, `static_assert(<kernel expression> == <host number>)` lines that codegen appends to
//! the rendered source, so a formula changed on one side only is a compile error naming both.

use metrale_core::shape::{Dims, KvDtype};

use crate::{
    DECODE_MAX_SPLITS, DECODE_NSTAMP, DECODE_TILE, FLASH_BN, FLASH_THREADS, PADDED_BLOCK,
    Q41_PANEL, TMA_BK, TMA_MAX_STAGES, TMA_SMEM, TOK_TILE_BYTES, TOK_TILE_MAX, WG_BK, WG_BM,
    WG_MAX_STAGES, WG_SMEM_LARGE, WG_SMEM_SMALL, WN_PANEL_BYTES, WQ_KS, WQ_MAX_STAGES, WQ_ROWS,
    WQ_SMEM,
};

/// Elements (`kv_t`) of one (block, layer, KV head) segment of the paged KV pool
/// (`mt::kv_seg<HEAD_DIM>()`): its KV_BLOCK head vectors and, for an fp8 cache, their KV_BLOCK f32
/// scales after them (one byte an element, so 4 elements a scale).
pub fn kv_seg(d: &Dims, kv: KvDtype) -> usize {
    crate::KV_BLOCK as usize * kv.vector_bytes(d.head_dim) / kv.bytes()
}

/// Floats of an activation row of `k` elements staged in shared memory (`mt::Padded<K>::FLOATS`).
pub fn padded(k: usize) -> usize {
    (k / 32) * PADDED_BLOCK as usize
}

/// Blocks `attention_hs` gives a (token, KV head, split) of a model whose KV heads are each shared
/// by `group` query heads (`HSPLIT` in `kernels/cuda/attention.cu.hbs`): [`crate::ATT_HS_HEADS`]
/// query heads a block where they divide the group, else one block.
pub fn att_head_blocks(group: usize) -> usize {
    let per = crate::ATT_HS_HEADS as usize;
    if group.is_multiple_of(per) {
        group / per
    } else {
        1
    }
}

/// Tokens a matrix-vector block stages for rows of `k` elements (`mt::TokTile<K>::N`): as many
/// padded rows as fit in [`TOK_TILE_BYTES`], between 1 and [`TOK_TILE_MAX`].
pub fn tok_tile(k: usize) -> usize {
    let bytes = padded(k) * 4;
    (TOK_TILE_BYTES as usize / bytes.max(1)).clamp(1, TOK_TILE_MAX as usize)
}

/// Words of one attention split's partial in `decode_1` (`PW`: max and sum per query head of the
/// group, then the group's unnormalised outputs).
pub fn decode_partial_words(d: &Dims) -> usize {
    d.group() * (2 + d.head_dim)
}

/// The four layer products of `decode_1` as (row pairs, 32-element quant blocks per row): QKV, O,
/// gate/up (interleaved, one pair per FFN row), down.
pub fn decode_products(d: &Dims) -> [(usize, usize); 4] {
    [
        ((d.qd() + 2 * d.kd()) / 2, d.hidden / 32),
        (d.hidden / 2, d.qd() / 32),
        (d.ffn, d.hidden / 32),
        (d.hidden / 2, d.ffn / 32),
    ]
}

/// u64 words of `decode_1`'s exchange buffer (`X_H + FFN`).
pub fn decode_exchange_words(d: &Dims) -> usize {
    d.hidden
        + (d.qd() + 2 * d.kd())
        + d.kv_heads * DECODE_MAX_SPLITS as usize * decode_partial_words(d)
        + d.hidden
        + d.ffn
}

/// Floats of `decode_1`'s fixed shared-memory regions (`S_PART`).
pub fn decode_static_floats(d: &Dims) -> usize {
    let ks = d.head_dim + 4;
    let maxs = DECODE_MAX_SPLITS as usize;
    let vecn = padded(d.hidden).max(padded(d.qd())).max(padded(d.ffn));
    let facn = (d.heads * maxs).div_ceil(4) * 4;
    let kvn = (2 * DECODE_TILE as usize * ks).max(d.kv_heads * maxs * decode_partial_words(d));
    2 * d.hidden + vecn + d.group() * d.head_dim + 2 * d.head_dim + d.head_dim + facn + kvn
}

/// Floats of the products' unit partials a block of a `blocks`-block grid holds
/// (`part_floats(blocks)`): the largest product share.
pub fn decode_part_floats(d: &Dims, blocks: usize) -> usize {
    decode_products(d)
        .iter()
        .map(|&(pairs, nb)| pairs.div_ceil(blocks.max(1)) * 2 * nb)
        .max()
        .unwrap_or(0)
}

/// Bytes of `decode_1`'s dynamic shared memory for a grid of `blocks` blocks.
pub fn decode_smem_bytes(d: &Dims, blocks: usize) -> usize {
    (decode_static_floats(d) + decode_part_floats(d, blocks)) * 4
}

/// u64 words of `decode_1`'s trace: `[blocks][layers][NSTAMP]` globaltimer stamps, then
/// `[blocks][4]` (kernel start, end in globaltimer ns; clock64 at start, end).
pub fn decode_trace_words(d: &Dims, blocks: usize) -> usize {
    blocks * d.layers * DECODE_NSTAMP as usize + blocks * 4
}

/// The token tiles of the Hopper GEMMs (`wg::gemm_any`'s cases).
pub const WG_TILES: [usize; 4] = [16, 32, 64, 128];

/// Weight-row tiles of [`WG_BM`] a Hopper GEMM block with token tile `n` computes
/// (`wg::row_tiles`): two for the 128-token tile (compute-bound: 128 x 128 reads 1.5x fewer operand
/// bytes per MMA than 64 x 128), else one.
pub fn wg_row_tiles(n: usize) -> usize {
    if n >= 128 {
        2
    } else {
        1
    }
}

/// Output rows of a Hopper GEMM block with token tile `n`.
pub fn wg_rows(n: usize) -> usize {
    WG_BM as usize * wg_row_tiles(n)
}

/// The weight formats of the Hopper GEMMs (`gemm_hopper.cu.hbs`'s `FBf16`, `FQ41`, `FQ80`): bf16
/// rows on the MMAs' shared-memory A side, or q4_1 / q8_0 blocks staged as stored and dequantised
/// into register fragments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgFormat {
    Bf16,
    Q4_1,
    Q8_0,
}

impl WgFormat {
    /// The format of a matrix of this dtype, where the Hopper GEMMs have one.
    pub fn of(dtype: &str) -> Option<WgFormat> {
        match dtype {
            "bf16" => Some(WgFormat::Bf16),
            "q4_1" => Some(WgFormat::Q4_1),
            "q8_0" => Some(WgFormat::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one weight row per pipeline stage of [`WG_BK`] elements (`ROW_BYTES`): 64 bf16; two
    /// q4_1 blocks (2 x 16 nibble bytes, 2 x (d, m)); two q8_0 blocks (2 x 32 bytes, 2 x d).
    pub fn row_bytes(self) -> usize {
        match self {
            WgFormat::Bf16 => 128,
            WgFormat::Q4_1 => 40,
            WgFormat::Q8_0 => 68,
        }
    }
}

/// Hopper GEMM blocks with token tile `n` that fit an SM (`wg::budget`): one for the 128-token tile
/// of bf16 weights, else two (quantized weights take a third of the stage bytes, and their
/// registers allow two blocks; a second warpgroup hides the dequantisation's latency).
pub fn wg_blocks_per_sm(n: usize, f: WgFormat) -> usize {
    if n >= 128 && f == WgFormat::Bf16 {
        1
    } else {
        2
    }
}

/// Bytes of a stage's weight rows (`wg::weight_bytes`): rounded up to the 1024 bytes the 128-byte
/// swizzle of the token rows after them repeats over.
pub fn wg_weight_bytes(n: usize, f: WgFormat) -> usize {
    (wg_rows(n) * f.row_bytes()).next_multiple_of(1024)
}

/// Bytes of one pipeline stage of a Hopper GEMM block with token tile `n` (`wg::stage_bytes`): its
/// weight rows and `n` token rows of [`WG_BK`] 16-bit activations.
pub fn wg_stage_bytes(n: usize, f: WgFormat) -> usize {
    wg_weight_bytes(n, f) + n * WG_BK as usize * 2
}

/// Pipeline stages of a Hopper GEMM block with token tile `n` (`wg::stages`): as many as fit in its
/// budget ([`WG_SMEM_SMALL`] where two blocks share an SM, else [`WG_SMEM_LARGE`]), at most
/// [`WG_MAX_STAGES`].
pub fn wg_stages(n: usize, f: WgFormat) -> usize {
    let budget = if wg_blocks_per_sm(n, f) == 1 {
        WG_SMEM_LARGE
    } else {
        WG_SMEM_SMALL
    } as usize;
    (budget / wg_stage_bytes(n, f)).min(WG_MAX_STAGES as usize)
}

/// Dynamic shared memory of a Hopper GEMM block with token tile `n` (`wg::smem_bytes`): its stages
/// and 1 KiB to align them to the 1024 bytes the 128-byte swizzle repeats over.
pub fn wg_smem_bytes(n: usize, f: WgFormat) -> usize {
    wg_stages(n, f) * wg_stage_bytes(n, f) + 1024
}

/// The token tiles of the warp-specialised Hopper GEMMs of quantized weights (`wg::gemm_ws_any`'s
/// cases). Each block computes [`WQ_ROWS`] weight rows.
pub const WQ_TILES: [usize; 4] = [16, 32, 64, 128];

/// Bytes of a `wq_*` stage's weight rows (`wq::weight_bytes`): [`WQ_ROWS`] rows of [`WQ_KS`]
/// k-steps each, rounded up to 1024 as [`wg_weight_bytes`].
pub fn wq_weight_bytes(f: WgFormat) -> usize {
    (WQ_ROWS as usize * WQ_KS as usize * f.row_bytes()).next_multiple_of(1024)
}

/// Bytes of one `wq_*` pipeline stage with token tile `n` (`wq::stage_bytes`): the weight rows,
/// then [`WQ_KS`] tiles of `n` token rows of [`WG_BK`] 16-bit activations.
pub fn wq_stage_bytes(n: usize, f: WgFormat) -> usize {
    wq_weight_bytes(f) + WQ_KS as usize * n * WG_BK as usize * 2
}

/// Pipeline stages of a `wq_*` block (`wq::stages`): as many as fit in [`WQ_SMEM`], at most
/// [`WQ_MAX_STAGES`].
pub fn wq_stages(n: usize, f: WgFormat) -> usize {
    (WQ_SMEM as usize / wq_stage_bytes(n, f)).min(WQ_MAX_STAGES as usize)
}

/// 32-element blocks per panel of a q4_1 matrix with rows of `k` elements (`mt::q41_panel<K>()`):
/// [`Q41_PANEL`] where it divides the row's blocks, else the whole row (then the panelled layout is
/// row-major). Block `b` of row `r` of a matrix of `rows` rows sits at
/// `(b / P) * rows * P + r * P + b % P` in both the nibble array (16 bytes a block) and the (d, m)
/// array (4 bytes a block).
pub fn q41_panel(k: usize) -> usize {
    let nb = k / 32;
    if nb.is_multiple_of(Q41_PANEL as usize) {
        Q41_PANEL as usize
    } else {
        nb
    }
}

/// Dynamic shared memory of a narrow GEMM block (`wn_*`, narrow_gemm.cuh) whose split covers
/// `panels` q4_1 panels of K: their activations, [`WN_PANEL_BYTES`] each.
pub fn wn_smem_bytes(panels: usize) -> usize {
    panels * WN_PANEL_BYTES as usize
}

/// Dynamic shared memory of a `wq_*` block (`wq::smem_bytes`): its stages and 1 KiB of alignment.
pub fn wq_smem_bytes(n: usize, f: WgFormat) -> usize {
    wq_stages(n, f) * wq_stage_bytes(n, f) + 1024
}

/// The block tiles of the warp-specialised Hopper GEMMs (`tma::bm`, `tma::bn`; a launch's `cfg` is an
/// index here): (tokens, weight rows). 128 tokens are the two consumer warpgroups' 64 rows each,
/// every warpgroup on all the block's weight rows; 64 tokens are shared by both warpgroups, each on
/// half the weight rows (for chunks where a 128-token tile would be mostly empty). The weight-row
/// widths are the wgmma N sizes that divide the 8B shape's products (6144, 4096, 28672, 128256
/// rows) into tile counts that fill 132 SMs well (`plan::tma_plan`); 96 rows for the QKV product
/// (6144 rows: 64 tiles, so one or two token tiles fill 128 of 132 SMs where 128-row tiles left
/// 96 in use), whose epilogue takes any pair of columns (a 48-row warpgroup half ends inside a
/// 32-column group, so the epilogues that write the next product's input cannot take 64 x 96).
pub const TMA_CONFIGS: [(usize, usize); 8] = [
    (128, 256),
    (128, 224),
    (128, 192),
    (128, 128),
    (64, 256),
    (64, 128),
    (128, 96),
    (64, 96),
];

/// Bytes of one pipeline stage of a warp-specialised GEMM block of tile `cfg` (`tma::stage_bytes`):
/// its token rows and weight rows, [`TMA_BK`] bf16 elements each.
pub fn tma_stage_bytes(cfg: usize) -> usize {
    let (bm, bn) = TMA_CONFIGS[cfg];
    (bm + bn) * TMA_BK as usize * 2
}

/// Pipeline stages of tile `cfg` (`tma::stages`): as many as fit in [`TMA_SMEM`], at most
/// [`TMA_MAX_STAGES`].
pub fn tma_stages(cfg: usize) -> usize {
    (TMA_SMEM as usize / tma_stage_bytes(cfg)).min(TMA_MAX_STAGES as usize)
}

/// Dynamic shared memory of tile `cfg` (`tma::smem_bytes`): its stages and 1 KiB to align them to
/// the 1024 bytes the 128-byte swizzle repeats over.
pub fn tma_smem_bytes(cfg: usize) -> usize {
    tma_stages(cfg) * tma_stage_bytes(cfg) + 1024
}

/// Tokens per block of `attention_flash` for `group` query heads per KV head: its 64 query rows
/// (16 per warp) hold every head of the group for each token (`fa::TOK`).
pub fn flash_tokens(group: usize) -> usize {
    (16 * FLASH_THREADS as usize / 32) / group.max(1)
}

/// Dynamic shared memory of `attention_flash` (`fa::smem_bytes`): two buffers of a K and a V tile
/// of `FLASH_BN` positions, each row padded by 8 bf16.
pub fn flash_smem_bytes(head_dim: usize) -> usize {
    2 * 2 * FLASH_BN as usize * (head_dim + 8) * 2
}

/// The `static_assert`s of template `template` for a target of shape `d` on `sm_count` SMs: each
/// compares an expression the kernel computes with the number the host computes for it. Empty for
/// templates whose launches depend on no host formula.
/// `formats`: the Hopper GEMMs' weight formats of the target (its layers' and LM head's).
pub fn asserts(
    template: &str,
    d: &Dims,
    sm_count: usize,
    formats: &[WgFormat],
    kv: KvDtype,
) -> String {
    let check = |expr: &str, host: usize, what: &str| {
        format!("static_assert({expr} == {host}, \"{what}: the kernel's formula and the host's (metrale-abi layout.rs) disagree\");\n")
    };
    let mut s = String::new();
    // the templates that find a position's K and V through `mt::kv_off` and size nothing
    // themselves: the pool's segment against the host's (`kv::block_bytes`)
    if matches!(template, "attention" | "qkv_rope" | "attn_in") {
        s += &check(
            "mt::kv_seg<HEAD_DIM>()",
            kv_seg(d, kv),
            "elements of a (block, layer, KV head) segment of the KV pool",
        );
    }
    match template {
        "attn_in" | "ffn_in" | "lm_head" => {
            s += &check("TB", tok_tile(d.hidden), "tokens per block")
        }
        "attn_out" => s += &check("TB", tok_tile(d.qd()), "tokens per block"),
        // moe: its Hopper products (moe_*_wg, moe_*_wq) are wg_gemm.cuh's kernels too
        "gemm_hopper" | "moe" => {
            for &f in formats {
                for n in WG_TILES {
                    s += &check(
                        &format!("wg::smem_bytes({n}, {})", f.row_bytes()),
                        wg_smem_bytes(n, f),
                        "dynamic shared memory per block",
                    );
                }
                if f == WgFormat::Q4_1 {
                    for k in [d.hidden, d.qd(), d.ffn] {
                        s += &check(
                            &format!("mt::q41_panel<{k}>()"),
                            q41_panel(k),
                            "q4_1 blocks per panel",
                        );
                    }
                }
                if f != WgFormat::Bf16 {
                    for n in WQ_TILES {
                        s += &check(
                            &format!("wq::smem_bytes({n}, {})", WQ_KS as usize * f.row_bytes()),
                            wq_smem_bytes(n, f),
                            "dynamic shared memory per block",
                        );
                    }
                }
            }
        }
        "gemm_tma" => {
            for (c, &(bm, bn)) in TMA_CONFIGS.iter().enumerate() {
                s += &check(&format!("tma::bm({c})"), bm, "tokens per block tile");
                s += &check(&format!("tma::bn({c})"), bn, "weight rows per block tile");
                s += &check(
                    &format!("tma::smem_bytes({c})"),
                    tma_smem_bytes(c),
                    "dynamic shared memory per block",
                );
            }
        }
        "ffn_out" => s += &check("TB", tok_tile(d.ffn), "tokens per block"),
        "attention_flash" => {
            s += &check(
                "fa::TOK",
                flash_tokens(d.heads / d.kv_heads),
                "tokens per block",
            );
            s += &check(
                "fa::smem_bytes()",
                flash_smem_bytes(d.head_dim),
                "dynamic shared memory per block",
            );
        }
        "decode" => {
            s += &check(
                "S_PART",
                decode_static_floats(d),
                "fixed shared memory floats",
            );
            s += &check(
                "X_H + FFN",
                decode_exchange_words(d),
                "exchange buffer words",
            );
            s += &check(
                &format!("part_floats({sm_count})"),
                decode_part_floats(d, sm_count),
                "unit partial floats at one block per SM",
            );
        }
        _ => {}
    }
    if !s.is_empty() {
        s.insert_str(
            0,
            "\n// The host's numbers for this target (metrale-abi layout.rs), checked at compile time.\n",
        );
    }
    s
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

    /// `attention_hs`'s blocks a (token, KV head, split): one query head a block (Qwen3-30B-A3B's
    /// group of 8: 8 blocks; Llama-3.1-8B's 4: 4; SmolLM2's 3: 3; a group of one: one block, so
    /// the host keeps such a model on `attention`).
    #[test]
    fn att_head_blocks_is_the_kernels_formula() {
        assert_eq!(crate::ATT_HS_HEADS, 1);
        assert_eq!(att_head_blocks(8), 8);
        assert_eq!(att_head_blocks(4), 4);
        assert_eq!(att_head_blocks(3), 3);
        assert_eq!(att_head_blocks(1), 1);
    }

    #[test]
    fn tok_tile_is_the_kernels_formula() {
        assert_eq!(tok_tile(576), 8);
        assert_eq!(tok_tile(1536), 5);
        assert_eq!(tok_tile(2048), 4);
        assert_eq!(tok_tile(8192), 1);
    }

    /// The decode layout sizes, computed by hand from the kernel's constants for SmolLM2-135M.
    #[test]
    fn decode_layout_for_smollm2() {
        let d = smollm();
        // X_A 576 + X_QKV (576 + 2 * 192) + X_PART 3*16*198 + X_B 576 + X_H 1536
        assert_eq!(decode_exchange_words(&d), 576 + 960 + 9504 + 576 + 1536);
        // xr 576 + xbr 576 + vec padded(1536)=1728 + q 192 + cur 128 + rope 64 + split factors 9*16
        // + kv max(2*64*68, 3*16*198) + unit partials max(4*36, 3*36, 12*36, 3*96) at 132 blocks
        assert_eq!(
            decode_smem_bytes(&d, 132),
            (576 + 576 + 1728 + 192 + 128 + 64 + 144 + 9504 + 432) * 4
        );
        // fewer blocks hold more units: gate/up's 1536 pairs over 24 blocks = 64 pairs of 2 x 18
        assert_eq!(
            decode_smem_bytes(&d, 24) - decode_smem_bytes(&d, 132),
            (64 * 36 - 432) * 4
        );
        assert_eq!(decode_trace_words(&d, 132), 132 * 30 * 12 + 132 * 4);
    }

    #[test]
    fn asserts_name_the_kernel_expressions() {
        let d = smollm();
        let a = asserts("decode", &d, 132, &[], KvDtype::Bf16);
        assert!(a.contains("static_assert(S_PART == 12912,"), "{a}");
        assert!(a.contains("static_assert(part_floats(132) == 432,"), "{a}");
        assert!(asserts("ffn_out", &d, 132, &[], KvDtype::Bf16).contains("static_assert(TB == 5,"));
        assert!(asserts("embed", &d, 132, &[], KvDtype::Bf16).is_empty());
        // the KV pool's segment: 16 vectors of 64, and for fp8 their 16 scales (4 bytes each)
        let k = asserts("attention", &d, 132, &[], KvDtype::Bf16);
        assert!(
            k.contains("static_assert(mt::kv_seg<HEAD_DIM>() == 1024,"),
            "{k}"
        );
        let k8 = asserts("qkv_rope", &d, 132, &[], KvDtype::Fp8);
        assert!(
            k8.contains("static_assert(mt::kv_seg<HEAD_DIM>() == 1088,"),
            "{k8}"
        );
        assert_eq!(kv_seg(&d, KvDtype::F32), 1024);
        // one per token tile and weight format, (quantized formats) one per warp-specialised tile,
        // and (q4_1) one per row length: the panel
        let g = asserts(
            "gemm_hopper",
            &d,
            132,
            &[WgFormat::Q4_1, WgFormat::Q8_0],
            KvDtype::Bf16,
        );
        assert_eq!(
            g.matches("static_assert").count(),
            8 + 2 * WQ_TILES.len() + 3
        );
        assert!(g.contains("wg::smem_bytes(16, 40) =="), "{g}");
        // SmolLM2: 576 = 18 blocks, row-major; 1536 = 48 blocks, panels of Q41_PANEL
        assert!(g.contains("mt::q41_panel<576>() == 18,"), "{g}");
        assert!(g.contains("mt::q41_panel<1536>() == 4,"), "{g}");
        assert!(g.contains("wq::smem_bytes(128, 136) =="), "{g}");
        assert_eq!(
            asserts("gemm_hopper", &d, 132, &[WgFormat::Bf16], KvDtype::Bf16)
                .matches("static_assert")
                .count(),
            4
        );
    }

    #[test]
    fn quantized_stages_are_smaller_and_two_blocks_share_an_sm() {
        use WgFormat::*;
        // bf16: 128-token tiles of 128 rows x 128 bytes + 128 tokens x 128 bytes, one block per SM
        assert_eq!(wg_stage_bytes(128, Bf16), 32768);
        assert_eq!(wg_blocks_per_sm(128, Bf16), 1);
        assert_eq!(wg_stages(128, Bf16), 6);
        // q4_1: 128 rows x 40 bytes (5120) + 16 KiB of tokens; two blocks per SM, 4 stages each
        assert_eq!(wg_stage_bytes(128, Q4_1), 5120 + 16384);
        assert_eq!((wg_blocks_per_sm(128, Q4_1), wg_stages(128, Q4_1)), (2, 4));
        // 64 rows x 40 = 2560 bytes rounded up to the swizzle's 1024
        assert_eq!(wg_weight_bytes(16, Q4_1), 3072);
        assert_eq!(wg_weight_bytes(64, Q8_0), 5120);
        // warp-specialised quantized blocks: 8 stages of 256 rows x 128 elements at 16 tokens
        // (160 KiB of weights in flight), 3 at 128 tokens; the output tile fits in the stages
        assert_eq!((wq_stage_bytes(16, Q4_1), wq_stages(16, Q4_1)), (24576, 8));
        assert_eq!(
            (wq_stage_bytes(128, Q4_1), wq_stages(128, Q4_1)),
            (53248, 3)
        );
        for n in WQ_TILES {
            for f in [Q4_1, Q8_0] {
                assert!(wq_stages(n, f) >= 2, "{n} {f:?}");
                assert!(wq_smem_bytes(n, f) <= 227 * 1024 - 1024, "{n} {f:?}");
                let tile = n * (WQ_ROWS as usize + 4) * 4;
                assert!(tile <= wq_stages(n, f) * wq_stage_bytes(n, f), "{n} {f:?}");
            }
        }
        for n in WG_TILES {
            for f in [Bf16, Q4_1, Q8_0] {
                assert!(wg_stages(n, f) >= 3, "{n} {f:?}");
                assert!(wg_blocks_per_sm(n, f) * wg_smem_bytes(n, f) <= 228 * 1024 - 2048);
                assert!(
                    wg_weight_bytes(n, f).is_multiple_of(1024)
                        && wg_stage_bytes(n, f).is_multiple_of(1024)
                );
            }
        }
    }
}
