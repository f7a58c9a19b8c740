//! Every `extern "C"` entry point of the CUDA kernels: its template, block size and arguments.
//!
//! Each entry is one `#[repr(C)]` struct whose fields are the kernel's parameters in order (device
//! pointers are `u64`). The field names are the parameter names the kernel body uses: codegen renders
//! the C signature from this list (`{{{abi.params.<entry>}}}`), so a kernel refers to its arguments by
//! these names, and [`crate::check_ptx`] compares the compiled signature with it. Shapes are not
//! arguments: they are compile-time constants of the target.

use std::ffi::c_void;

use crate::{EntryDecl, KernelArgs, Param, Ty};
use crate::{
    ATT_THREADS, DECODE_THREADS, EMBED_THREADS, FLASH_THREADS, GEMM_THREADS, MOE_SORT_THREADS,
    MV_THREADS, QKV_ROPE_THREADS, SAMPLE_THREADS, SPLIT_THREADS, TMA_THREADS, WG_THREADS,
    WN_THREADS, WQ_THREADS,
};

macro_rules! field_ty {
    (ptr) => {
        u64
    };
    (i32) => {
        i32
    };
    (u32) => {
        u32
    };
    (tmap) => {
        crate::TmaMap
    };
}

macro_rules! param_ty {
    (ptr, $c:literal) => {
        Ty::Ptr($c)
    };
    (i32) => {
        Ty::I32
    };
    (u32) => {
        Ty::U32
    };
    (tmap) => {
        Ty::TensorMap
    };
}

// One entry's argument struct and its `KernelArgs` (what `entries!` makes of each declaration).
macro_rules! entry_struct {
    (
        $(#[doc = $doc:expr])*
        $name:ident = $template:literal / $entry:literal, threads $threads:expr, {
            $($field:ident : $kind:ident $(<$cty:literal>)?),* $(,)?
        }
    ) => {
        $(#[doc = $doc])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        pub struct $name { $(pub $field: field_ty!($kind)),* }

        impl KernelArgs for $name {
            const ID: Entry = Entry::$name;
            const DECL: EntryDecl = EntryDecl {
                template: $template,
                entry: $entry,
                threads: $threads,
                params: &[$(Param { name: stringify!($field), ty: param_ty!($kind $(, $cty)?) }),*],
            };
            fn with_ptrs<R>(&mut self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                let mut p = [$(std::ptr::addr_of_mut!(self.$field) as *mut c_void),*];
                f(&mut p)
            }
        }
    };
}

// `From` an entry's arguments to its twin's (the same fields).
macro_rules! twin_from {
    ($from:ident => $to:ident, { $($field:ident : $kind:ident $(<$cty:literal>)?),* $(,)? }) => {
        impl From<$from> for $to {
            fn from(a: $from) -> $to {
                $to { $($field: a.$field),* }
            }
        }
    };
}

// One declaration of `entries!`: the entry, and its twins where it has some.
macro_rules! entry_pair {
    (
        [$(#[doc = $doc:expr])*] $name:ident = $template:literal / $entry:literal, threads $threads:expr,
        [$(twin $twin:ident = $tentry:literal, threads $tthreads:expr),*] $fields:tt
    ) => {
        entry_struct! { $(#[doc = $doc])* $name = $template / $entry, threads $threads, $fields }
        $(
            entry_struct! {
                #[doc = concat!("`", $tentry, "`: a twin of [`", stringify!($name), "`] (the same parameters).")]
                $twin = $template / $tentry, threads $tthreads, $fields
            }
            twin_from!($name => $twin, $fields);
        )*
    };
}

// Every entry: `Name = "template" / "entry", threads N, { params }`. Each `twin Name2 = "entry2",
// threads M,` after the threads declares another entry of the same template taking the same
// parameters (another block shape of the same product), with `From<Name> for Name2`.
macro_rules! entries {
    ($(
        $(#[doc = $doc:literal])*
        $name:ident = $template:literal / $entry:literal, threads $threads:expr,
        $(twin $twin:ident = $tentry:literal, threads $tthreads:expr,)*
        { $($fields:tt)* }
    )*) => {
        /// Every entry point: the index of its declaration in [`ENTRIES`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Entry { $($name, $($twin,)*)* }

        /// Every entry point's declaration, in [`Entry`] order.
        pub const ENTRIES: &[EntryDecl] = &[$(<$name as KernelArgs>::DECL, $(<$twin as KernelArgs>::DECL,)*)*];

        $(
            entry_pair! {
                [$(#[doc = $doc])*] $name = $template / $entry, threads $threads,
                [$(twin $twin = $tentry, threads $tthreads),*] { $($fields)* }
            }
        )*
    };
}

entries! {
    /// Token embedding lookup: `x[t] = dequant(table row tokens[t])`. grid = (ntok).
    Embed = "embed" / "embed", threads EMBED_THREADS, {
        qs: ptr<"const void">,
        sc: ptr<"const void">,
        tokens: ptr<"const int">,
        x: ptr<"float">,
        ntok: i32,
    }
    /// RMSNorm + fused QKV projection + RoPE; q to a buffer, k and v into the paged KV cache (block
    /// `tables[slot[t] * max_blocks + pos[t] / KV_BLOCK]`).
    /// grid = `plan::mv_grid(QKV row pairs, hidden, ntok)`.
    AttnIn = "attn_in" / "attn_in", threads MV_THREADS, {
        x: ptr<"const float">,
        norm_w: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        rope: ptr<"const float2">,
        q: ptr<"float">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        ntok: i32,
    }
    /// Families with `features.qkv_rope` (Q/K/V biases, a per-head Q/K RMSNorm): the QKV product
    /// (`attn_in` or a GEMM epilogue) leaves raw rows `qkv[ntok][QD + 2 KD]`; each warp takes one
    /// head of one token: + `bias` (`[QD + 2 KD]`, `features.qkv_bias`), RMSNorm with `q_norm` /
    /// `k_norm` (`head_dim` weights each, `features.qk_norm`), RoPE, q to `q`, k and v into the
    /// paged KV cache; an unused pointer is null.
    /// grid = (ntok, ceil((heads + 2 kv_heads) / (QKV_ROPE_THREADS / 32))).
    QkvRope = "qkv_rope" / "qkv_rope", threads QKV_ROPE_THREADS, {
        qkv: ptr<"const float">,
        bias: ptr<"const float">,
        q_norm: ptr<"const float">,
        k_norm: ptr<"const float">,
        rope: ptr<"const float2">,
        q: ptr<"float">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        ntok: i32,
    }
    /// `attn_in` and `qkv_rope` in one launch for one token (sm_90, the `qkv_rope` template; not
    /// on an fp8 KV cache): RMSNorm(x), one QKV row pair a warp, then the pair's bias, its head's
    /// RMSNorm (the head's `head_dim / 2` warps are a thread-block cluster of
    /// `head_dim / (2 MV_WARPS)` blocks that add their squares through shared memory), RoPE, q to
    /// `q` and k, v into the paged KV cache, with `qkv_rope`'s pointers.
    /// grid = (1, (QD + 2 KD) / (2 MV_WARPS)), cluster (1, head_dim / (2 MV_WARPS)).
    AttnInHead = "qkv_rope" / "attn_in_head", threads MV_THREADS, {
        x: ptr<"const float">,
        norm_w: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        bias: ptr<"const float">,
        q_norm: ptr<"const float">,
        k_norm: ptr<"const float">,
        rope: ptr<"const float2">,
        q: ptr<"float">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
    }
    /// Families with routed experts (`features.moe`): RMSNorm(x) with the FFN norm into `xn`, the
    /// router's logits (`router`: f32 `[experts][hidden]`), softmax, the `used` largest (ties to
    /// the lower index) renormalised, written as `ids` / `wts` `[ntok][used]` in ascending expert
    /// order; each choice counted in `counts[experts]` (the run's expert histogram; null: not
    /// counted). grid = (ceil(ntok / MOE_ROUTE_TOKENS), router blocks): a tile of tokens' router
    /// rows spread over its blocks, whose logits meet in `logits[ntok][experts]`; the last to
    /// take the ticket of the tile's first token in `ticket[ntok]` (zeroed; re-armed by it)
    /// routes.
    MoeRoute = "moe" / "moe_route", threads MV_THREADS, {
        x: ptr<"const float">,
        norm_w: ptr<"const float">,
        router: ptr<"const float">,
        xn: ptr<"float">,
        ids: ptr<"int">,
        wts: ptr<"float">,
        counts: ptr<"unsigned int">,
        logits: ptr<"float">,
        ticket: ptr<"unsigned int">,
        ntok: i32,
    }
    /// One token's O projection and residual add (`attn_out`'s, the same bits) with the sums its
    /// routing needs: `rcols[hidden][experts]` (f32) the router's columns times the FFN norm's
    /// weights; each block adds its share of the new residual's router logits (before the
    /// norm's scale) and of its sum of squares to `racc[experts + 1]` (u64, fixed point, zero
    /// before; `moe_gu` routes from it, `moe_down` zeroes it). grid = (row-pair groups).
    MoeOutRoute = "moe" / "moe_out_route", threads MV_THREADS, {
        att: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        rcols: ptr<"const float">,
        racc: ptr<"unsigned long long">,
    }
    /// Each routed (token, expert) pair's gate and up products and SiLU: `h[pair][expert_ffn]`.
    /// `w`: every expert's gate/up matrix (rows interleaved as `ffn_in`'s) stacked by expert.
    /// grid = (ntok * used, row-pair groups).
    /// `xn`: the tokens' normed FFN input and `ids` their experts; or, with `racc` (the sums
    /// `moe_out_route` left; null: none), every block routes the token as `moe_route` would and
    /// one writes `ids`, `wts` and `counts` (null: not counted); `xn` is then the residual, normed
    /// here with `norm_w` (the FFN norm's weights).
    MoeGu = "moe" / "moe_gu", threads MV_THREADS, {
        xn: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        ids: ptr<"int">,
        norm_w: ptr<"const float">,
        racc: ptr<"const unsigned long long">,
        wts: ptr<"float">,
        counts: ptr<"unsigned int">,
        h: ptr<"float">,
        ntok: i32,
    }
    /// Each token's experts' down products weighted by the router and added, in ascending
    /// expert order, to the residual `x`. `w`: every expert's down matrix stacked by expert.
    /// `racc` (unless null): `moe_out_route`'s sums, zeroed (`moe_gu` has read them).
    /// grid = (ntok, row-pair groups).
    MoeDown = "moe" / "moe_down", threads MV_THREADS, {
        h: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        ids: ptr<"const int">,
        wts: ptr<"const float">,
        x: ptr<"float">,
        racc: ptr<"unsigned long long">,
        ntok: i32,
    }
    /// Many tokens' routed pairs grouped by expert (one block): `offsets[e] .. offsets[e + 1]` of
    /// `order` are the pairs (`t * used + k`) routed to expert e (`offsets`: experts + 1 words),
    /// in no fixed order within an expert (each pair's products are its own); unless `tiles` is
    /// null, the tensor-core products' work list: `tiles[0]` tiles, then (expert, first pair
    /// of the tile) for each GEMM_BM of an expert's pairs (`moe_tiles` + 1 words at most). grid = (1).
    MoeSort = "moe" / "moe_sort", threads MOE_SORT_THREADS, {
        ids: ptr<"const int">,
        offsets: ptr<"int">,
        order: ptr<"int">,
        tiles: ptr<"int">,
        ntok: i32,
    }
    /// `moe_gu` by expert: a block group per expert reads its gate/up rows once for tiles of its
    /// tokens (`moe_sort`'s groups), `h[pair][expert_ffn]` as `moe_gu` writes it.
    /// grid = (row-pair groups, experts).
    MoeGuGrouped = "moe" / "moe_gu_grouped", threads MV_THREADS, {
        xn: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        offsets: ptr<"const int">,
        order: ptr<"const int">,
        h: ptr<"float">,
        ntok: i32,
    }
    /// The down products by expert, as `moe_gu_grouped`: each pair's unweighted output
    /// `y[pair][hidden]`. grid = (row-pair groups, experts).
    MoeDownGrouped = "moe" / "moe_down_grouped", threads MV_THREADS, {
        h: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        offsets: ptr<"const int">,
        order: ptr<"const int">,
        y: ptr<"float">,
        ntok: i32,
    }
    /// The grouped products on the tensor cores (mma.sync, `gemm_mma.cuh`: activations split
    /// into f16 hi + lo, f32 accumulation): `xn`'s `ntok` rows (K = hidden) split for
    /// `moe_gu_mma`. grid = `plan::split_grid(ntok)`.
    MoeSplitX = "moe" / "moe_split_x", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        hi: ptr<"__half">,
        lo: ptr<"__half">,
        asx: ptr<"float">,
        ntok: i32,
    }
    /// The pairs' `h` rows (`ntok * used` of them, K = expert ffn) split for `moe_down_mma`.
    /// grid = `plan::split_grid(ntok * used)`.
    MoeSplitH = "moe" / "moe_split_h", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        hi: ptr<"__half">,
        lo: ptr<"__half">,
        asx: ptr<"float">,
        ntok: i32,
    }
    /// `moe_gu_grouped` as a GEMM: a block per (GEMM_BN gate/up rows, tile of `moe_sort`'s
    /// list: GEMM_BM of one expert's pairs), A gathered from `moe_split_x`'s rows (the pair's
    /// token). grid = (2 * expert ffn / GEMM_BN, `moe_tiles`); blocks past the count do nothing.
    MoeGuMma = "moe" / "moe_gu_mma", threads GEMM_THREADS, {
        ahi: ptr<"const __half">,
        alo: ptr<"const __half">,
        asx: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        offsets: ptr<"const int">,
        order: ptr<"const int">,
        tiles: ptr<"const int">,
        h: ptr<"float">,
        ntok: i32,
    }
    /// `moe_down_grouped` as a GEMM over `moe_split_h`'s pair rows: `y[pair][hidden]`.
    /// grid = (hidden / GEMM_BN, `moe_tiles`).
    MoeDownMma = "moe" / "moe_down_mma", threads GEMM_THREADS, {
        ahi: ptr<"const __half">,
        alo: ptr<"const __half">,
        asx: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        offsets: ptr<"const int">,
        order: ptr<"const int">,
        tiles: ptr<"const int">,
        y: ptr<"float">,
        ntok: i32,
    }
    /// The grouped products on Hopper's wgmma (sm_90a; `wg_gemm.cuh`, the dense products'
    /// kernels over gathered rows, `Gpu::moe_wg`): a block per (tile of `moe_sort`'s list,
    /// weight-row tile of the expert), the tile's rows of `a` gathered through `order`: `a` holds
    /// the tokens' normed input in act_t (`WgActHead` of the residual with the FFN norm), and
    /// `h[pair][expert_ffn]` gets act_t(SiLU(gate) * up). grid = (`moe_tiles`, 2 * expert ffn /
    /// `wg_rows(GEMM_BM)`), dynamic shared memory `layout::wg_smem_bytes(GEMM_BM)`; the
    /// warp-specialised twin (quantized weights): grid.y = 2 * expert ffn / WQ_ROWS, dynamic
    /// shared memory `layout::wq_smem_bytes(GEMM_BM)`. Blocks past the list's count do nothing;
    /// `ntok` sizes the grid only.
    MoeGuWg = "moe" / "moe_gu_wg", threads WG_THREADS,
        twin MoeGuWq = "moe_gu_wq", threads WQ_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        offsets: ptr<"const int">,
        order: ptr<"const int">,
        tiles: ptr<"const int">,
        h: ptr<"act_t">,
        ntok: i32,
    }
    /// The down products of `MoeGuWg`'s `h` rows, unweighted: `y[pair][hidden]` (f32) for
    /// `moe_combine`. grid.y = hidden / `wg_rows(GEMM_BM)` (twin: hidden / WQ_ROWS).
    MoeDownWg = "moe" / "moe_down_wg", threads WG_THREADS,
        twin MoeDownWq = "moe_down_wq", threads WQ_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        offsets: ptr<"const int">,
        order: ptr<"const int">,
        tiles: ptr<"const int">,
        y: ptr<"float">,
        ntok: i32,
    }
    /// Each token's pairs' outputs `y`, weighted and summed in ascending expert order (as
    /// `moe_down` sums them), added to the residual `x`. grid = (ntok).
    MoeCombine = "moe" / "moe_combine", threads MV_THREADS, {
        y: ptr<"const float">,
        wts: ptr<"const float">,
        x: ptr<"float">,
        ntok: i32,
    }
    /// Split-K GQA attention over the paged KV cache, the splits combined in the same launch.
    /// grid = (kv_heads >> pack, nsplit, ntok), pack = (flags >> ATT_PACK_SHIFT) & 3 (0 unless
    /// nsplit = 1); `counter` holds ntok * kv_heads zeroed tickets. Twin `attention_hs`: each block a part of the group's query heads
    /// (`layout::att_head_blocks` blocks a (token, KV head, split): grid.z = ntok times that;
    /// `counter` holds that many tickets a (token, KV head)).
    Attention = "attention" / "attention", threads ATT_THREADS,
        twin AttentionHs = "attention_hs", threads ATT_THREADS, {
        q: ptr<"const float">,
        kc: ptr<"const kv_t">,
        vc: ptr<"const kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        nsplit: i32,
        flags: i32,
        part_ml: ptr<"float2">,
        part_acc: ptr<"float">,
        counter: ptr<"unsigned int">,
        out: ptr<"void">,
    }
    /// Causal GQA attention of prompt chunks on the tensor cores (flash attention) over the paged KV
    /// cache. grid = (ntiles, kv_heads), dynamic shared memory `layout::flash_smem_bytes`; `tiles`
    /// holds (first token, tokens) per block, each tile one sequence's consecutive positions.
    AttentionFlash = "attention_flash" / "attention_flash", threads FLASH_THREADS, {
        q: ptr<"const float">,
        kc: ptr<"const kv_t">,
        vc: ptr<"const kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        tiles: ptr<"const int">,
        flags: i32,
        out: ptr<"void">,
    }
    /// Output projection + residual: `x += Wo att`.
    AttnOut = "attn_out" / "attn_out", threads MV_THREADS, {
        att: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        ntok: i32,
    }
    /// RMSNorm + gate/up (interleaved rows) + SiLU(gate) * up.
    FfnIn = "ffn_in" / "ffn_in", threads MV_THREADS, {
        x: ptr<"const float">,
        norm_w: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        h: ptr<"float">,
        ntok: i32,
    }
    /// Down projection + residual: `x += Wdown h`.
    FfnOut = "ffn_out" / "ffn_out", threads MV_THREADS, {
        h: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        ntok: i32,
    }
    /// Final RMSNorm + LM head on the selected rows, with the greedy pick and its logprob fused.
    LmHead = "lm_head" / "lm_head", threads MV_THREADS, {
        x: ptr<"const float">,
        sel: ptr<"const int">,
        norm_w: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        logits: ptr<"float">,
        ntok: i32,
        part: ptr<"mt::Acc">,
        counter: ptr<"unsigned int">,
        out_tok: ptr<"int">,
        out_logprob: ptr<"float">,
    }
    /// The one-output LM head (batch-1 decode): whole rows streamed in 16-byte chunks.
    LmHeadOne = "lm_head" / "lm_head_1", threads MV_THREADS, {
        x: ptr<"const float">,
        sel: ptr<"const int">,
        norm_w: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        logits: ptr<"float">,
        ntok: i32,
        part: ptr<"mt::Acc">,
        counter: ptr<"unsigned int">,
        out_tok: ptr<"int">,
        out_logprob: ptr<"float">,
    }
    /// Greedy arg-max of each logits row and its log-softmax, each row spread over the blocks
    /// along x (`plan::argmax_splits`): `part` one `mt::Acc` per block, `counter` one ticket per
    /// row (zero between launches). grid = (splits, ntok).
    ArgmaxLogprob = "sample" / "argmax_logprob", threads SAMPLE_THREADS, {
        logits: ptr<"const float">,
        part: ptr<"mt::Acc">,
        counter: ptr<"unsigned int">,
        out_tok: ptr<"int">,
        out_logprob: ptr<"float">,
        ntok: i32,
    }
    /// Grammar masks applied to logits rows in place: row `t` takes mask row `rows[t]` (`-1`:
    /// none) of `masks` (`ceil(VOCAB / 32)` words each, bit `v % 32` of word `v / 32` allowing
    /// token `v`); a token not allowed gets -inf. grid = (nout).
    MaskLogits = "sample" / "mask_logits", threads SAMPLE_THREADS, {
        logits: ptr<"float">,
        masks: ptr<"const unsigned int">,
        rows: ptr<"const int">,
        nout: i32,
    }
    /// One row's greedy arg-max and log-softmax over the tokens its grammar mask allows (`masks`:
    /// `ceil(VOCAB / 32)` words as in `MaskLogits`, or null: every token), the row spread over the
    /// grid: a partial per block in `part`, the last block (ticket `counter`, zero at launch and
    /// re-armed) merges them. The logits stay as they were. grid = (any).
    ArgmaxMaskedOne = "sample" / "argmax_masked_1", threads SAMPLE_THREADS, {
        logits: ptr<"const float">,
        masks: ptr<"const unsigned int">,
        part: ptr<"mt::Acc">,
        counter: ptr<"unsigned int">,
        out_tok: ptr<"int">,
        out_logprob: ptr<"float">,
    }
    /// Temperature / top-k / top-p / min-p sampling with the seeded draw, one row per block.
    SampleProbs = "sample" / "sample_probs", threads SAMPLE_THREADS, {
        logits: ptr<"const float">,
        params: ptr<"const abi::SampleParams">,
        out_tok: ptr<"int">,
        out_logprob: ptr<"float">,
        status: ptr<"int">,
        nout: i32,
    }
    /// The whole batch-1 decode step in one persistent cooperative launch (one block per SM).
    DecodeOne = "decode" / "decode_1", threads DECODE_THREADS, {
        lw: ptr<"const abi::LayerW">,
        emb_qs: ptr<"const void">,
        emb_sc: ptr<"const void">,
        head_qs: ptr<"const void">,
        head_sc: ptr<"const void">,
        out_norm: ptr<"const float">,
        rope: ptr<"const float2">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        tables: ptr<"const unsigned int">,
        token: i32,
        pos: i32,
        slot: i32,
        max_blocks: i32,
        epoch: u32,
        flags: i32,
        att_cfg: i32,
        xch: ptr<"unsigned long long">,
        logits: ptr<"float">,
        part: ptr<"mt::Acc">,
        counter: ptr<"unsigned int">,
        out_tok: ptr<"int">,
        out_logprob: ptr<"float">,
        trace: ptr<"unsigned long long">,
    }
    /// GEMM path: RMSNorm(x) split into f16 hi/lo and block sums. grid = (ceil(ntok / 8)).
    NormSplit = "gemm" / "norm_split", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        norm_w: ptr<"const float">,
        hi: ptr<"__half">,
        lo: ptr<"__half">,
        asx: ptr<"float">,
        ntok: i32,
    }
    /// GEMM path: the attention output split (K = heads x head_dim).
    SplitQd = "gemm" / "split_qd", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        hi: ptr<"__half">,
        lo: ptr<"__half">,
        asx: ptr<"float">,
        ntok: i32,
    }
    /// GEMM path: the FFN activation split (K = ffn).
    SplitFfn = "gemm" / "split_ffn", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        hi: ptr<"__half">,
        lo: ptr<"__half">,
        asx: ptr<"float">,
        ntok: i32,
    }
    /// GEMM path: QKV projection with the RoPE + KV-write epilogue. grid = `plan::gemm_grid`.
    GemmQkv = "gemm" / "gemm_qkv", threads GEMM_THREADS, {
        ahi: ptr<"const __half">,
        alo: ptr<"const __half">,
        asx: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        rope: ptr<"const float2">,
        q: ptr<"float">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        ntok: i32,
    }
    /// GEMM path: output projection + residual.
    GemmO = "gemm" / "gemm_o", threads GEMM_THREADS, {
        ahi: ptr<"const __half">,
        alo: ptr<"const __half">,
        asx: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        ntok: i32,
    }
    /// GEMM path: gate/up + SiLU(gate) * up.
    GemmGu = "gemm" / "gemm_gu", threads GEMM_THREADS, {
        ahi: ptr<"const __half">,
        alo: ptr<"const __half">,
        asx: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        h: ptr<"float">,
        ntok: i32,
    }
    /// GEMM path: down projection + residual.
    GemmDown = "gemm" / "gemm_down", threads GEMM_THREADS, {
        ahi: ptr<"const __half">,
        alo: ptr<"const __half">,
        asx: ptr<"const float">,
        wqs: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        ntok: i32,
    }
    /// Hopper GEMM path: the QKV and gate/up products' input from the residual `x`: a =
    /// act_t(x * norm_w) (`act_t`: bf16 for bf16 weights, f16 for quantized weights, whose products
    /// run W4A16 / W8A16) and the squares of x summed over each `SS_COLS` columns into `ss`; the
    /// product applies the RMSNorm's scale. grid = (ntok): a block per token.
    WgActNorm = "gemm_hopper" / "wg_act_norm", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        norm_w: ptr<"const float">,
        a: ptr<"act_t">,
        ss: ptr<"float">,
        ntok: i32,
    }
    /// Hopper GEMM path: act_t(RMSNorm(x[sel[t]])) with the output norm, the LM head's input.
    WgActHead = "gemm_hopper" / "wg_act_head", threads SPLIT_THREADS, {
        x: ptr<"const float">,
        sel: ptr<"const int">,
        norm_w: ptr<"const float">,
        a: ptr<"act_t">,
        ntok: i32,
    }
    /// Hopper GEMM path: QKV projection with the RoPE + KV-write epilogue. grid and dynamic shared
    /// memory: `plan::wg_plan`; `ws` and `counters`: its split-K partials and tickets; `w`, `wsc`: the
    /// weights' `qs` and `sc` (common.cuh; `wsc` unused for bf16). Each `wg_*` entry (one warpgroup)
    /// has a `wq_*` twin for quantized weights: warp-specialised blocks (a producer and two consumer
    /// warpgroups), grid and dynamic shared memory `plan::wq_plan`. The input `a` is unscaled
    /// (`WgActNorm`): a token's outputs are scaled by the RMSNorm factor of its squares in `ss`.
    WgQkv = "gemm_hopper" / "wg_qkv", threads WG_THREADS,
        twin WqQkv = "wq_qkv", threads WQ_THREADS,
        twin WnQkv = "wn_qkv", threads WN_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        rope: ptr<"const float2">,
        q: ptr<"float">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        ntok: i32,
        tile_n: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        ss: ptr<"const float">,
    }
    /// Hopper GEMM path: output projection + residual; where `an` is not null, the next product's
    /// input from the new residual as `wg_act_norm` writes it (`norm_w`: its RMSNorm's weight).
    WgO = "gemm_hopper" / "wg_o", threads WG_THREADS,
        twin WqO = "wq_o", threads WQ_THREADS,
        twin WnO = "wn_o", threads WN_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        ntok: i32,
        tile_n: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        an: ptr<"act_t">,
        norm_w: ptr<"const float">,
        ss: ptr<"float">,
    }
    /// Hopper GEMM path: gate/up + SiLU(gate) * up, h in act_t: the down product's activations
    /// as it reads them (no conversion between the two). Its input is unscaled: each token's
    /// products are scaled by the RMSNorm factor of its squares in `ss` (`abi::SS_COLS`), as QKV's.
    WgGu = "gemm_hopper" / "wg_gu", threads WG_THREADS,
        twin WqGu = "wq_gu", threads WQ_THREADS,
        twin WnGu = "wn_gu", threads WN_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        h: ptr<"act_t">,
        ntok: i32,
        tile_n: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        ss: ptr<"const float">,
    }
    /// Hopper GEMM path: the LM head's logits (bf16 or q8_0 head), `ntok` rows.
    WgLogits = "gemm_hopper" / "wg_logits", threads WG_THREADS,
        twin WqLogits = "wq_logits", threads WQ_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        logits: ptr<"float">,
        ntok: i32,
        tile_n: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
    }
    /// Hopper GEMM path: down projection + residual, and the next product's input as `WgO`.
    WgDown = "gemm_hopper" / "wg_down", threads WG_THREADS,
        twin WqDown = "wq_down", threads WQ_THREADS,
        twin WnDown = "wn_down", threads WN_THREADS, {
        a: ptr<"const act_t">,
        w: ptr<"const void">,
        wsc: ptr<"const void">,
        x: ptr<"float">,
        ntok: i32,
        tile_n: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        an: ptr<"act_t">,
        norm_w: ptr<"const float">,
        ss: ptr<"float">,
    }
    /// Warp-specialised Hopper GEMM (kernels/cuda/gemm_tma.cu.hbs): the QKV product with the RoPE +
    /// KV-write epilogue. `amap`, `wmap`: tensor maps of the bf16 activations and weights; `cfg`:
    /// the block tile (`layout::TMA_CONFIGS`); `splits`: K splits; grid = (blocks, 1, 1), each block
    /// looping over its units; dynamic shared memory `layout::tma_smem_bytes(cfg)` (`plan::tma_plan`).
    /// Its input is unscaled, as `WgQkv`'s (the RMSNorm factor from `ss`).
    TmaQkv = "gemm_tma" / "tma_qkv", threads TMA_THREADS, {
        amap: tmap,
        wmap: tmap,
        rope: ptr<"const float2">,
        q: ptr<"float">,
        kc: ptr<"kv_t">,
        vc: ptr<"kv_t">,
        pos: ptr<"const int">,
        slot: ptr<"const int">,
        tables: ptr<"const unsigned int">,
        layer: i32,
        max_blocks: i32,
        ntok: i32,
        cfg: i32,
        splits: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        ss: ptr<"const float">,
    }
    /// Warp-specialised Hopper GEMM: output projection + residual, and the next product's input
    /// where `an` is not null (as `WgO`).
    TmaO = "gemm_tma" / "tma_o", threads TMA_THREADS, {
        amap: tmap,
        wmap: tmap,
        x: ptr<"float">,
        ntok: i32,
        cfg: i32,
        splits: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        an: ptr<"__nv_bfloat16">,
        norm_w: ptr<"const float">,
        ss: ptr<"float">,
    }
    /// Warp-specialised Hopper GEMM: gate/up + SiLU(gate) * up, h in bf16 (the down product's
    /// activations).
    TmaGu = "gemm_tma" / "tma_gu", threads TMA_THREADS, {
        amap: tmap,
        wmap: tmap,
        h: ptr<"__nv_bfloat16">,
        ntok: i32,
        cfg: i32,
        splits: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        ss: ptr<"const float">,
    }
    /// Warp-specialised Hopper GEMM: down projection + residual, and the next product's input
    /// where `an` is not null (as `WgO`).
    TmaDown = "gemm_tma" / "tma_down", threads TMA_THREADS, {
        amap: tmap,
        wmap: tmap,
        x: ptr<"float">,
        ntok: i32,
        cfg: i32,
        splits: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
        an: ptr<"__nv_bfloat16">,
        norm_w: ptr<"const float">,
        ss: ptr<"float">,
    }
    /// Warp-specialised Hopper GEMM: the LM head's logits (bf16 head), `ntok` rows.
    TmaLogits = "gemm_tma" / "tma_logits", threads TMA_THREADS, {
        amap: tmap,
        wmap: tmap,
        logits: ptr<"float">,
        ntok: i32,
        cfg: i32,
        splits: i32,
        ws: ptr<"float">,
        counters: ptr<"unsigned int">,
    }
}
