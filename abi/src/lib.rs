//! metrale-abi: the host↔kernel ABI of the CUDA kernels, stated once.
//!
//! Everything both sides of a launch must agree on is declared here, in Rust, and nowhere else:
//! - **Entry points** ([`entries`]): one `#[repr(C)]` argument struct per `extern "C"` entry point,
//!   whose fields are the kernel's parameters in order, with the threads per block it is compiled
//!   and launched for. Codegen renders each entry's C parameter list into its template
//!   (`{{{abi.params.<entry>}}}`) and, after compiling, compares the PTX `.entry` declaration
//!   (parameter count, each parameter's type, `.maxntid`) with the declaration ([`check_ptx`]),
//!   refusing a mismatch by kernel and parameter name. The CUDA backend launches with the struct's
//!   fields as the kernel arguments and the declared block size.
//! - **Constants** ([`CONSTS`]): thread counts, tiles, split maxima and sentinel values, rendered into
//!   every template as `abi::NAME` by the `{{> abi}}` partial, together with the device structs
//!   ([`device`]) the host writes into device memory.
//! - **Layout formulas** ([`layout`]): what the host sizes buffers and grids by. The kernels keep
//!   their own `constexpr` formulas where they are used; codegen appends `static_assert`s to each
//!   rendered template that tie them to the host's numbers for the target ([`layout::asserts`]), so a
//!   formula changed on one side only fails the build.
//!
//! Invariants: a kernel's parameter types and order, its block size, and every constant above exist
//! once, here; nothing here touches a GPU or a compiler.

pub mod device;
pub mod entries;
pub mod layout;

use std::ffi::c_void;

pub use entries::*;

/// The type of one kernel parameter as the host passes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    /// A device pointer (u64 on the host), with the C type it points to, e.g. `"const float"`.
    Ptr(&'static str),
    /// `int`.
    I32,
    /// `unsigned int`.
    U32,
    /// A TMA tensor map ([`TmaMap`], 128 bytes) passed by value: `const __grid_constant__
    /// abi::TmaMap` in the kernel, whose bulk tensor copies read it where it lies (the parameter
    /// space), so no device buffer holds maps and a graph captures them with the launch.
    TensorMap,
}

impl Ty {
    /// The PTX parameter type this compiles to.
    pub fn ptx(self) -> &'static str {
        match self {
            Ty::Ptr(_) => ".u64",
            Ty::I32 | Ty::U32 => ".u32",
            Ty::TensorMap => ".align 64 .b8",
        }
    }

    /// What the host passes, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Ty::Ptr(_) => "a device pointer",
            Ty::I32 => "an int",
            Ty::U32 => "an unsigned int",
            Ty::TensorMap => "a 128-byte TMA tensor map",
        }
    }
}

/// A TMA tensor map as the driver encodes it (`cuTensorMapEncodeTiled`: 128 opaque bytes, 64-byte
/// aligned), passed to a kernel by value ([`Ty::TensorMap`]).
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TmaMap(pub [u64; 16]);

/// One parameter of an entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    pub name: &'static str,
    pub ty: Ty,
}

impl Param {
    /// Its C declaration in the kernel's signature. Pointers the kernel writes are `__restrict__`;
    /// read-only ones are not, because `const` and `__restrict__` together let the compiler read
    /// through the non-coherent cache (`ld.global.nc`), which requires the data not to change while
    /// the kernel lives. Under programmatic dependent launch the previous kernel is still writing
    /// the activations when this one starts, so they must be read coherently; the weights, which
    /// nothing writes, are read with explicit `__ldg`.
    pub fn c_decl(&self) -> String {
        match self.ty {
            Ty::Ptr(t) if t.starts_with("const ") => format!("{t}* {}", self.name),
            Ty::Ptr(t) => format!("{t}* __restrict__ {}", self.name),
            Ty::I32 => format!("int {}", self.name),
            Ty::U32 => format!("unsigned int {}", self.name),
            Ty::TensorMap => format!("const __grid_constant__ abi::TmaMap {}", self.name),
        }
    }
}

/// The declaration of one `extern "C"` entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryDecl {
    /// The template (`kernels/cuda/<template>.cu.hbs`) that defines it.
    pub template: &'static str,
    /// Its name in the PTX.
    pub entry: &'static str,
    /// Threads per block: its `__launch_bounds__` (PTX `.maxntid`) and every launch's block size.
    pub threads: u32,
    pub params: &'static [Param],
}

impl EntryDecl {
    /// The C parameter list the template's signature is rendered with.
    pub fn c_params(&self) -> String {
        self.params
            .iter()
            .map(Param::c_decl)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// An entry point's arguments: a `#[repr(C)]` struct whose fields are its parameters in order.
pub trait KernelArgs: Copy {
    /// Its index in [`ENTRIES`].
    const ID: Entry;
    const DECL: EntryDecl;
    /// Call `f` with a pointer to each field, in parameter order: the `kernelParams` array of
    /// `cuLaunchKernel(Ex)`, valid while `f` runs.
    fn with_ptrs<R>(&mut self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
}

/// The templates a CUDA target compiles, in the order of [`ENTRIES`] (each holds one or more entries).
pub fn templates() -> Vec<&'static str> {
    let mut t: Vec<&'static str> = Vec::new();
    for e in ENTRIES {
        if !t.contains(&e.template) {
            t.push(e.template);
        }
    }
    t
}

/// The entry points declared for `template`.
pub fn entries_of(template: &str) -> impl Iterator<Item = &'static EntryDecl> + '_ {
    ENTRIES.iter().filter(move |e| e.template == template)
}

/// Threads per block of the matrix-vector kernels (`attn_in`, `attn_out`, `ffn_in`, `ffn_out`,
/// `lm_head`, `lm_head_1`); each warp owns a row pair at a time.
pub const MV_THREADS: u32 = 256;
/// Threads per block of `qkv_rope` (one warp per head of a token).
pub const QKV_ROPE_THREADS: u32 = 256;
/// Threads of `moe_sort`'s one block.
pub const MOE_SORT_THREADS: u32 = 1024;
/// Tokens one `moe_route` block routes (grid.x = ceil(ntok / this)): each router row it reads
/// serves them all, where a block a token read the whole router (1 MB at 30B-A3B) for each token
/// of a prompt chunk.
pub const MOE_ROUTE_TOKENS: u32 = 4;
/// Threads per block of `embed`.
pub const EMBED_THREADS: u32 = 256;
/// Threads per block of `attention`.
pub const ATT_THREADS: u32 = 256;
/// Most attention splits `attention` combines through one thread-block cluster (8 is the portable
/// cluster size); launches with more splits use the global ticket combine.
pub const ATT_MAX_CLUSTER: u32 = 8;
/// `attention`'s `flags` bit that sums its scores by a transpose-reduce (16 shuffles for the GROUP x
/// 4 scores of an iteration where one warp sum each takes 5, and one exp per lane instead of one per
/// score; the default, `METRALE_CUDA_TUNING=attention_transpose=off` turns it off), else one warp
/// sum per score.
pub const ATT_FLAG_TRANSPOSE: u32 = 1;
/// `attention`'s and `attention_flash`'s `flags` bit that writes the output as the Hopper GEMMs'
/// 16-bit activations (`act_t`: bf16 for bf16 weights, f16 for quantized ones), which the O
/// product reads as they are; else f32. Set where the chunk's products run on the Hopper path.
pub const ATT_FLAG_OUT16: u32 = 2;
/// Query heads each block of `attention_hs` serves where they divide a KV head's group (else the
/// whole group): a (token, KV head, split) takes group / this many blocks. One: a one-token step
/// of Qwen3-30B-A3B (4 KV heads of 8) runs 32 blocks, each warp's iteration one head's scores.
pub const ATT_HS_HEADS: u32 = 1;
/// `attention`'s `flags` bits from this one (two of them) hold log2 of the (token, KV head) pairs
/// one block serves, its `ATT_THREADS / 32` warps shared evenly among them (one split only; grid =
/// (kv_heads >> that, 1, ntok)). 0: one pair a block, as every split launch runs.
pub const ATT_PACK_SHIFT: u32 = 2;
/// Threads per block of `attention_flash` (4 warps of 16 query rows each) and the key positions of
/// one of its K/V tiles in shared memory (`kernels/cuda/attention_flash.cu.hbs`).
pub const FLASH_THREADS: u32 = 128;
pub const FLASH_BN: u32 = 64;
/// Threads per block of `argmax_logprob` and `sample_probs`.
pub const SAMPLE_THREADS: u32 = 1024;
/// Floats of a 32-element block of an activation row staged in shared memory (padded from 32 so
/// that lane L reading block L with 16-byte loads is free of bank conflicts).
pub const PADDED_BLOCK: u32 = 36;
/// Shared-memory bytes a matrix-vector block may use for staged token rows, and the most tokens it
/// stages (`mt::TokTile`, [`layout::tok_tile`]).
pub const TOK_TILE_BYTES: u32 = 40960;
pub const TOK_TILE_MAX: u32 = 8;
/// Bytes of one `mt::Acc` greedy partial (max, sum, index) in the LM head's partials buffer.
pub const ACC_BYTES: u32 = 12;
/// Threads per block of `decode_1`, the persistent batch-1 decode kernel (one block per SM).
pub const DECODE_THREADS: u32 = 512;
/// Most attention splits per KV head `decode_1` is compiled for (its launch may ask for fewer).
pub const DECODE_MAX_SPLITS: u32 = 16;
/// K/V positions `decode_1` stages in shared memory at a time.
pub const DECODE_TILE: u32 = 64;
/// Trace stamps per (block, layer) of `decode_1` (written when `flags` has [`DECODE_FLAG_TRACE`]).
pub const DECODE_NSTAMP: u32 = 12;
/// `decode_1`'s `flags` bit that makes it write its trace. (Bits 8..23 are a poll back-off in ns that
/// the host leaves at 0; the kernel keeps the branch because its spin loop measured 3% slower
/// compiled without it.)
pub const DECODE_FLAG_TRACE: u32 = 4;
/// `decode_1`'s `token` that makes it read its input token from `out_tok`: the greedy pick of the
/// launch before it in the stream (run-ahead).
pub const TOKEN_FROM_DEVICE: i32 = -1;
/// What `decode_1` writes to `out_tok` when its dynamic shared memory is smaller than its layout
/// (the host's [`layout::decode_smem_bytes`] disagrees with the kernel): nothing else runs.
pub const DECODE_REFUSED: i32 = -2;
/// Threads per block of the tensor-core GEMMs (`gemm_*`) and the tile each block computes.
pub const GEMM_THREADS: u32 = 128;
pub const GEMM_BM: u32 = 32;
pub const GEMM_BN: u32 = 64;
/// Threads per block of the Hopper GEMMs (`wg_*`, kernels/cuda/gemm_hopper.cu.hbs): one warpgroup.
/// A block computes [`WG_BM`] output rows (twice that for the 128-token tile,
/// [`layout::wg_row_tiles`]) for a tile of 16, 32, 64 or 128 tokens, [`WG_BK`] elements of K per
/// pipeline stage (one 128-byte swizzle row of bf16).
pub const WG_THREADS: u32 = 128;
pub const WG_BM: u32 = 64;
pub const WG_BK: u32 = 64;
/// Shared memory of one Hopper GEMM block's pipeline stages: for the token tiles up to 64 (two
/// blocks fit an SM's 228 KiB) and for the 128-token tile (one block per SM), and the most stages
/// ([`layout::wg_stages`]).
pub const WG_SMEM_SMALL: u32 = 98304;
pub const WG_SMEM_LARGE: u32 = 200704;
pub const WG_MAX_STAGES: u32 = 8;
/// Threads per block of the warp-specialised Hopper GEMMs of quantized weights (`wq_*`,
/// kernels/cuda/gemm_hopper.cu.hbs): a producer warpgroup (cp.async) and two consumer warpgroups
/// that dequantise into registers and run wgmma, on [`WQ_ROWS`] weight rows a block. A stage holds
/// [`WQ_KS`] k-steps of [`WG_BK`] elements (a q4_1 row's stage is 64 contiguous bytes of nibbles);
/// the stages fill at most [`WQ_SMEM`] bytes, at most [`WQ_MAX_STAGES`] of them
/// ([`layout::wq_stages`]).
pub const WQ_THREADS: u32 = 384;
pub const WQ_ROWS: u32 = 256;
pub const WQ_KS: u32 = 2;
pub const WQ_SMEM: u32 = 200704;
pub const WQ_MAX_STAGES: u32 = 16;
/// Threads per block of the narrow Hopper GEMMs of q4_1 weights (`wn_*`,
/// kernels/cuda/gemm_hopper.cu.hbs, narrow_gemm.cuh): chunks of at most [`WN_TOKENS`] tokens (a
/// verification step, a few sequences) on mma.sync, each warp on 16 weight rows that it streams
/// from memory into registers and dequantises there, [`WN_ROWS`] rows a block, K split across
/// blocks so that two blocks an SM fill the GPU. The block's share of the activations is staged in
/// shared memory, [`WN_PANEL_BYTES`] for each q4_1 panel of K.
pub const WN_THREADS: u32 = 256;
pub const WN_TOKENS: u32 = 8;
pub const WN_ROWS: u32 = 16 * (WN_THREADS / 32);
pub const WN_PANEL_BYTES: u32 = WN_TOKENS * Q41_PANEL * 32 * 2;
/// The q4_1 device layout's panel: [`Q41_PANEL`] 32-element blocks of K (one `wq_*` stage of
/// [`WQ_KS`] k-steps). A q4_1 matrix is stored panel by panel, each panel row-major over all the
/// rows, so that one stage of every row tile is one contiguous span (`layout::q41_panel`).
pub const Q41_PANEL: u32 = 2 * WQ_KS;
/// Threads per block of the warp-specialised Hopper GEMMs (`tma_*`, kernels/cuda/gemm_tma.cu.hbs):
/// a producer warpgroup (one thread issues the bulk tensor copies) and two consumer warpgroups on
/// wgmma. [`TMA_BK`] elements of K per pipeline stage (one 128-byte swizzle row of bf16); the
/// copies move boxes of [`TMA_ABOX`] activation rows and [`TMA_WBOX`] weight rows; the stages of a
/// block fill at most [`TMA_SMEM`] bytes, and at most [`TMA_MAX_STAGES`].
pub const TMA_THREADS: u32 = 384;
pub const TMA_BK: u32 = 64;
pub const TMA_ABOX: u32 = 64;
pub const TMA_WBOX: u32 = 32;
pub const TMA_SMEM: u32 = 229376;
pub const TMA_MAX_STAGES: u32 = 8;
/// Tokens per block of the paged KV cache (`metrale_core::shape::KV_BLOCK`): K and V of a
/// sequence's position p live in pool block `tables[slot * max_blocks + p / KV_BLOCK]`, laid out
/// `[block][layer][kv_head][KV_BLOCK][head_dim]` in the target's KV type (`kv_t`: f32, bf16, or fp8
/// with each (block, layer, KV head) segment's KV_BLOCK f32 scales after its vectors:
/// `layout::kv_seg`).
pub const KV_BLOCK: u32 = metrale_core::shape::KV_BLOCK as u32;
/// Threads per block of the GEMM path's split kernels (`norm_split`, `split_qd`, `split_ffn`): a
/// warp per token, so `SPLIT_THREADS / 32` tokens per block.
pub const SPLIT_THREADS: u32 = 256;
/// The Hopper products whose input is an RMSNorm of the residual (QKV, gate/up) take it unscaled,
/// `act_t(x * norm_w)`, with the squares of `x` summed over each [`SS_COLS`] columns
/// (`ss[ntok][hidden / SS_COLS]`, f32); they scale their outputs by `rsqrt(mean(x^2) + eps)` of
/// their token. `wg_act_norm` writes both, and so do the O and down products' epilogues for the
/// product after them (their `an`, `norm_w`, `ss`), so no conversion runs between the products.
pub const SS_COLS: u32 = 32;

/// Every constant rendered into the templates (`abi::NAME`), by name.
pub const CONSTS: &[(&str, i64)] = &[
    ("MV_THREADS", MV_THREADS as i64),
    ("EMBED_THREADS", EMBED_THREADS as i64),
    ("QKV_ROPE_THREADS", QKV_ROPE_THREADS as i64),
    ("MOE_SORT_THREADS", MOE_SORT_THREADS as i64),
    ("MOE_ROUTE_TOKENS", MOE_ROUTE_TOKENS as i64),
    ("ATT_THREADS", ATT_THREADS as i64),
    ("ATT_MAX_CLUSTER", ATT_MAX_CLUSTER as i64),
    ("ATT_FLAG_TRANSPOSE", ATT_FLAG_TRANSPOSE as i64),
    ("ATT_FLAG_OUT16", ATT_FLAG_OUT16 as i64),
    ("ATT_PACK_SHIFT", ATT_PACK_SHIFT as i64),
    ("ATT_HS_HEADS", ATT_HS_HEADS as i64),
    ("FLASH_THREADS", FLASH_THREADS as i64),
    ("FLASH_BN", FLASH_BN as i64),
    ("SAMPLE_THREADS", SAMPLE_THREADS as i64),
    ("PADDED_BLOCK", PADDED_BLOCK as i64),
    ("TOK_TILE_BYTES", TOK_TILE_BYTES as i64),
    ("TOK_TILE_MAX", TOK_TILE_MAX as i64),
    ("ACC_BYTES", ACC_BYTES as i64),
    ("DECODE_THREADS", DECODE_THREADS as i64),
    ("DECODE_MAX_SPLITS", DECODE_MAX_SPLITS as i64),
    ("DECODE_TILE", DECODE_TILE as i64),
    ("DECODE_NSTAMP", DECODE_NSTAMP as i64),
    ("DECODE_FLAG_TRACE", DECODE_FLAG_TRACE as i64),
    ("TOKEN_FROM_DEVICE", TOKEN_FROM_DEVICE as i64),
    ("DECODE_REFUSED", DECODE_REFUSED as i64),
    ("GEMM_THREADS", GEMM_THREADS as i64),
    ("GEMM_BM", GEMM_BM as i64),
    ("GEMM_BN", GEMM_BN as i64),
    ("WG_THREADS", WG_THREADS as i64),
    ("WG_BM", WG_BM as i64),
    ("WG_BK", WG_BK as i64),
    ("WG_SMEM_SMALL", WG_SMEM_SMALL as i64),
    ("WG_SMEM_LARGE", WG_SMEM_LARGE as i64),
    ("WG_MAX_STAGES", WG_MAX_STAGES as i64),
    ("WQ_THREADS", WQ_THREADS as i64),
    ("WQ_ROWS", WQ_ROWS as i64),
    ("WQ_KS", WQ_KS as i64),
    ("WQ_SMEM", WQ_SMEM as i64),
    ("WQ_MAX_STAGES", WQ_MAX_STAGES as i64),
    ("Q41_PANEL", Q41_PANEL as i64),
    ("WN_THREADS", WN_THREADS as i64),
    ("WN_TOKENS", WN_TOKENS as i64),
    ("WN_ROWS", WN_ROWS as i64),
    ("WN_PANEL_BYTES", WN_PANEL_BYTES as i64),
    ("SPLIT_THREADS", SPLIT_THREADS as i64),
    ("SS_COLS", SS_COLS as i64),
    ("TMA_THREADS", TMA_THREADS as i64),
    ("TMA_BK", TMA_BK as i64),
    ("TMA_ABOX", TMA_ABOX as i64),
    ("TMA_WBOX", TMA_WBOX as i64),
    ("TMA_SMEM", TMA_SMEM as i64),
    ("TMA_MAX_STAGES", TMA_MAX_STAGES as i64),
    ("KV_BLOCK", KV_BLOCK as i64),
];

/// The C++ text of the `abi` namespace every CUDA template renders (`{{> abi}}`) before including
/// `common.cuh`: the constants and the device structs.
pub fn prelude() -> String {
    let mut s = String::from(
        "// The host<->kernel ABI of this kernel set (metrale-abi, abi/src): constants and the structs the\n\
         // host writes into device memory. Rendered from the Rust declarations; do not restate them here.\n\
         #define METRALE_ABI 1\nnamespace abi {\n\
         // an enum, not constexpr variables: NVRTC emits a .global for every namespace-scope constexpr\n\
         enum : int {\n",
    );
    for (name, v) in CONSTS {
        s.push_str(&format!("    {name} = {v},\n"));
    }
    s.push_str("};\n");
    for d in device::STRUCTS {
        s.push_str(&d.c_definition());
    }
    s.push_str(
        "// a TMA tensor map (the driver's CUtensorMap, opaque), passed to kernels by value\n\
         struct alignas(64) TmaMap { unsigned long long v[16]; };\n",
    );
    s.push_str("}  // namespace abi\n");
    s
}

/// A compiled kernel's entry points disagree with their declaration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbiMismatch {
    pub entry: String,
    /// The parameter (index and declared name), when the mismatch is one parameter.
    pub param: Option<(usize, String)>,
    pub message: String,
}

impl std::fmt::Display for AbiMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.param {
            Some((i, name)) => write!(
                f,
                "entry `{}`, parameter {i} `{name}`: {}",
                self.entry, self.message
            ),
            None => write!(f, "entry `{}`: {}", self.entry, self.message),
        }
    }
}

/// One `.entry` of a PTX module: its name, parameter types in order, and `.maxntid` x.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxEntry {
    pub name: String,
    pub params: Vec<String>,
    pub maxntid: Option<u32>,
}

/// The `.entry` declarations of a PTX module (comments skipped).
pub fn ptx_entries(ptx: &str) -> Vec<PtxEntry> {
    let lines: Vec<&str> = ptx
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let mut toks = lines[i].split_whitespace();
        let Some(after) = toks.by_ref().skip_while(|t| *t != ".entry").nth(1) else {
            i += 1;
            continue;
        };
        let name = after.split('(').next().unwrap_or(after).trim().to_string();
        // the parameter list: from the '(' to the matching ')', one `.param` per comma
        let mut text = String::new();
        let mut j = i;
        while j < lines.len() {
            text.push_str(lines[j]);
            text.push('\n');
            if lines[j].contains(')') {
                break;
            }
            j += 1;
        }
        let inner = text
            .split_once('(')
            .map_or("", |(_, r)| r.split(')').next().unwrap_or(""));
        let params = inner
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                // `.param .u64 name`, `.param .u64 .ptr .global .align 4 name`, `.param .align 8 .b8 name[32]`
                let words: Vec<&str> = p.split_whitespace().collect();
                match words.get(1) {
                    Some(w) if w.starts_with(".align") => words[1..words.len() - 1].join(" "),
                    Some(w) => w.to_string(),
                    None => p.to_string(),
                }
            })
            .collect();
        // the directives between the ')' and the body's '{'
        let mut maxntid = None;
        let mut k = j;
        while k < lines.len() {
            if let Some(m) = lines[k].find(".maxntid") {
                maxntid = lines[k][m + ".maxntid".len()..]
                    .split(',')
                    .next()
                    .and_then(|x| x.trim().parse().ok());
            }
            if lines[k].contains('{') {
                break;
            }
            k += 1;
        }
        out.push(PtxEntry {
            name,
            params,
            maxntid,
        });
        i = j + 1;
    }
    out
}

/// Compare the entry points of `template`'s PTX with their declarations in [`ENTRIES`]: the same
/// set of entries, and for each the same number of parameters, each of the declared PTX type, and a
/// `.maxntid` equal to the declared threads. Templates the ABI does not declare (test fixtures) are
/// not checked.
pub fn check_ptx(template: &str, ptx: &str) -> Result<(), AbiMismatch> {
    let declared: Vec<&EntryDecl> = entries_of(template).collect();
    if declared.is_empty() {
        return Ok(());
    }
    let found = ptx_entries(ptx);
    for f in &found {
        if !declared.iter().any(|d| d.entry == f.name) {
            return Err(AbiMismatch {
                entry: f.name.clone(),
                param: None,
                message: format!(
                    "template {template} defines it, but the ABI (abi/src/entries.rs) does not declare it; declare its arguments there"
                ),
            });
        }
    }
    for d in declared {
        let Some(f) = found.iter().find(|f| f.name == d.entry) else {
            return Err(AbiMismatch {
                entry: d.entry.into(),
                param: None,
                message: format!(
                    "declared in the ABI for template {template}, but its PTX has no such entry point"
                ),
            });
        };
        for (i, p) in d.params.iter().enumerate() {
            let Some(got) = f.params.get(i) else {
                return Err(AbiMismatch {
                    entry: d.entry.into(),
                    param: Some((i, p.name.into())),
                    message: format!(
                        "the host passes {} ({}), but the compiled kernel has only {} parameters",
                        p.ty.describe(),
                        p.ty.ptx(),
                        f.params.len()
                    ),
                });
            };
            if got != p.ty.ptx() {
                return Err(AbiMismatch {
                    entry: d.entry.into(),
                    param: Some((i, p.name.into())),
                    message: format!(
                        "the host passes {} ({}), but the compiled kernel declares {got}: the template's signature disagrees with the ABI; render it as {{{{{{abi.params.{}}}}}}}",
                        p.ty.describe(),
                        p.ty.ptx(),
                        d.entry
                    ),
                });
            }
        }
        if f.params.len() > d.params.len() {
            return Err(AbiMismatch {
                entry: d.entry.into(),
                param: None,
                message: format!(
                    "the compiled kernel has {} parameters, the ABI declares {}",
                    f.params.len(),
                    d.params.len()
                ),
            });
        }
        if f.maxntid != Some(d.threads) {
            return Err(AbiMismatch {
                entry: d.entry.into(),
                param: None,
                message: format!(
                    "launched with {} threads per block, but compiled with __launch_bounds__ giving .maxntid {:?}",
                    d.threads, f.maxntid
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = "
.visible .entry embed(
\t.param .u64 embed_param_0,
\t.param .u64 .ptr .align 1 embed_param_1,
\t.param .u64 embed_param_2,
\t.param .u64 embed_param_3,
\t.param .u32 embed_param_4
)
.maxntid 256, 1, 1
{
\tret;
}
";

    #[test]
    fn ptx_entries_are_parsed_with_types_and_launch_bounds() {
        let e = ptx_entries(PTX);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].name, "embed");
        assert_eq!(e[0].params, vec![".u64", ".u64", ".u64", ".u64", ".u32"]);
        assert_eq!(e[0].maxntid, Some(256));
        assert!(check_ptx("embed", PTX).is_ok());
        // comments and odd spacing; an entry without parameters or bounds
        let names: Vec<String> = ptx_entries(
            ".version 9.0\n.visible .entry rmsnorm_576(\n\t.param .u64 a\n)\n.entry  k2 (\n)\n{\n// .entry not_this\n",
        )
        .into_iter()
        .map(|e| e.name)
        .collect();
        assert_eq!(names, vec!["rmsnorm_576", "k2"]);
        // a template the ABI does not declare is not checked
        assert!(check_ptx("fixture", PTX).is_ok());
    }

    #[test]
    fn a_swapped_parameter_is_named() {
        let swapped = PTX
            .replace(".u64 embed_param_0", ".u32 embed_param_0")
            .replace(".u32 embed_param_4", ".u64 embed_param_4");
        let e = check_ptx("embed", &swapped).unwrap_err();
        assert_eq!(e.param, Some((0, "qs".into())));
        let msg = e.to_string();
        assert!(
            msg.contains("entry `embed`, parameter 0 `qs`") && msg.contains(".u32"),
            "{msg}"
        );
        let short = PTX.replace(",\n\t.param .u32 embed_param_4", "");
        assert!(check_ptx("embed", &short)
            .unwrap_err()
            .to_string()
            .contains("parameter 4 `ntok`"));
        let bounds = PTX.replace(".maxntid 256", ".maxntid 128");
        assert!(check_ptx("embed", &bounds)
            .unwrap_err()
            .to_string()
            .contains("256 threads"));
        let renamed = PTX.replace("entry embed(", "entry embed2(");
        assert!(check_ptx("embed", &renamed)
            .unwrap_err()
            .to_string()
            .contains("does not declare it"));
    }

    #[test]
    fn every_entry_has_unique_name_and_struct_layout_matches_its_params() {
        let mut names: Vec<&str> = ENTRIES.iter().map(|e| e.entry).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ENTRIES.len());
        for (i, e) in ENTRIES.iter().enumerate() {
            assert!(!e.params.is_empty(), "{}", e.entry);
            assert!(e.threads.is_multiple_of(32), "{}", e.entry);
            let _ = i;
        }
        // the launch arrays point at every field, in order
        let mut a = Embed {
            qs: 1,
            sc: 2,
            tokens: 3,
            x: 4,
            ntok: 5,
        };
        let vals = a.with_ptrs(|p| {
            assert_eq!(p.len(), Embed::DECL.params.len());
            (
                unsafe { *(p[0] as *const u64) },
                unsafe { *(p[3] as *const u64) },
                unsafe { *(p[4] as *const i32) },
            )
        });
        assert_eq!(vals, (1, 4, 5));
        assert_eq!(Embed::ID as usize, 0);
        assert_eq!(ENTRIES[DecodeOne::ID as usize].entry, "decode_1");
    }

    #[test]
    fn prelude_declares_every_constant() {
        let p = prelude();
        for (n, v) in CONSTS {
            assert!(p.contains(&format!("    {n} = {v},\n")), "{n}");
        }
        assert!(p.contains("struct SampleParams {"));
    }
}
