//! Typed launchers: a [`Device`] with one target's kernels loaded, and one method per entry point
//! that takes the entry's argument struct (`metrale_abi::entries`), computes the grid the entry's
//! declaration states (`plan`) and launches it with the declared block size. No positional
//! argument list exists anywhere: a kernel's parameters are the struct's fields.
//!
//! Invariants: every launch's block size is `metrale_abi`'s for the entry, and its arguments are the
//! entry's struct, whose layout `build-target` (and `Kernels::load`) checked against the compiled
//! kernel's PTX signature; programmatic dependent launch on sm_90+; thread-block clusters only
//! where the target allows them.

use std::ops::Deref;

use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use metrale_abi as abi;
use metrale_abi::layout::WgFormat;
use metrale_abi::KernelArgs;
use metrale_core::shape::Dims;
use metrale_core::BackendError;

use super::device::{dev_err, Device, LaunchHow};
use super::kernels::{KernelSet, Kernels};
use super::plan;

/// What the driver says of a kernel at a launch shape: resident blocks per SM, registers and
/// local-memory bytes per thread (-1 where it did not say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    pub per_sm: u32,
    pub regs: i32,
    pub local_bytes: i32,
}

/// A device with one target's kernels loaded.
pub struct Gpu {
    pub dev: Device,
    kernels: Kernels,
    /// The shape the kernels were compiled for.
    pub dims: Dims,
    /// The routed experts the kernels were compiled for (`moe` template), if the family has them.
    pub moe: Option<MoeShape>,
    /// Launch with programmatic dependent launch (sm_90+).
    pub pdl: bool,
    /// Small split-K attention launches may run on `attention_hs` ([`Gpu::attention_heads_pay`]).
    pub attention_heads: bool,
    /// A one-token step routes inside its O product (`moe_out_route`; the target has it and
    /// `Tuning::moe_route_fused`): [`Gpu::route_fused`].
    pub moe_route_fused: bool,
    /// A one-token QKV product with the `qkv_rope` family's work runs as one launch
    /// (`attn_in_head`: sm_90, the target has it, not an fp8 KV cache, its grid one wave, and
    /// `Tuning::attn_in_head`): [`Gpu::qkv_head_fused`].
    pub attn_in_head: bool,
    /// Most attention splits launched as one thread-block cluster (the target's
    /// `attention_cluster`; 0 or 1: none, and none before sm_90).
    pub cluster_max: usize,
    /// Resident blocks of `lm_head_1` per SM (the driver's occupancy for its registers).
    pub lm1_per_sm: usize,
    /// Resident blocks per SM of each matrix-vector kernel (their grids are one wave at most).
    mv_per_sm: MvPerSm,
    /// One output's LM head by `lm_head_1` (else `lm_head`).
    pub lm_head_1: bool,
    /// `argmax_logprob` spreads a row over [`plan::argmax_splits`] blocks (else one).
    pub argmax_split: bool,
    /// The warp-specialised products may take the 96-row tiles (made for QKV).
    pub tma_96: bool,
    /// `attention`'s flags (`abi::ATT_FLAG_TRANSPOSE`).
    pub att_flags: i32,
    /// One-split `attention` launches serve several (token, KV head) pairs a block
    /// ([`plan::attention_pack`]), else one.
    pub att_pack: bool,
    /// Resident blocks of `attention` per SM (the driver's occupancy for its registers).
    pub att_per_sm: usize,
    /// Steps whose experts run grouped take the tensor-core products (`moe_gu_mma`,
    /// `moe_down_mma`), else the CUDA-core ones (`moe_gu_grouped`, `moe_down_grouped`).
    pub moe_mma: bool,
    /// Steps whose experts run grouped take Hopper's wgmma products (`moe_gu_wg` /
    /// `moe_down_wg`, or their warp-specialised twins `moe_gu_wq` / `moe_down_wq` with quantized
    /// weights, where [`Gpu::wq_gemm`]): as [`Gpu::hopper_gemm`], on a target with routed
    /// experts whose kernels the driver gave the dynamic shared memory they need; else
    /// [`Gpu::moe_mma`] chooses.
    pub moe_wg: bool,
    /// The GEMM path runs the Hopper kernels (`wg_*`): the modules are the sm_90a cubins of a
    /// target with bf16 weights or with `[quant] gemm_activations = "f16"` (q4_1 weights, W4A16),
    /// and the driver gave their blocks the dynamic shared memory they need.
    pub hopper_gemm: bool,
    /// The Hopper GEMM path may run the warp-specialised kernels (`tma_*`, `gemm_tma.cu.hbs`): as
    /// [`Gpu::hopper_gemm`] with bf16 weights, and the driver gave their blocks the dynamic shared
    /// memory they need.
    pub tma_gemm: bool,
    /// The Hopper GEMMs of quantized weights run on the warp-specialised kernels (`wq_*`,
    /// `gemm_hopper.cu.hbs`'s `gemm_ws`): as [`Gpu::hopper_gemm`] with quantized weights, and the
    /// driver gave their blocks the dynamic shared memory they need.
    pub wq_gemm: bool,
    /// Chunks of at most `abi::WN_TOKENS` tokens run the Hopper GEMMs of q4_1 layers on the narrow
    /// kernels (`wn_*`, narrow_gemm.cuh): as [`Gpu::wq_gemm`], on a shape whose products they
    /// take (`plan::wn_pays`), and the driver gave their blocks the shared memory they stage.
    pub wn_gemm: bool,
    /// Prompt chunks run their attention on the tensor cores (`attention_flash`): the target's KV
    /// cache is bf16 and the driver gave the kernel the dynamic shared memory it needs.
    pub flash_attention: bool,
    /// The Hopper GEMMs' formats of the layer matrices and of the LM head (their stages; `None`:
    /// a dtype they do not read).
    wg_layer: Option<WgFormat>,
    wg_head: Option<WgFormat>,
}

/// The argument structs of the Hopper GEMMs (`wg_*` and their warp-specialised `wq_*` twins):
/// the token tile their plan chose goes into `tile_n`.
trait Tiled: KernelArgs {
    fn set_tile(&mut self, n: i32);
}

macro_rules! tiled {
    ($($t:ty),*) => {$(
        impl Tiled for $t {
            fn set_tile(&mut self, n: i32) {
                self.tile_n = n;
            }
        }
    )*};
}

tiled!(
    abi::WgQkv,
    abi::WgO,
    abi::WgGu,
    abi::WgDown,
    abi::WgLogits,
    abi::WqQkv,
    abi::WqO,
    abi::WqGu,
    abi::WqDown,
    abi::WqLogits,
    abi::WnQkv,
    abi::WnO,
    abi::WnGu,
    abi::WnDown
);

/// Resident blocks per SM assumed for a matrix-vector kernel whose occupancy is not asked (the
/// grouped routed products) or that the driver does not answer for: the grid cap before
/// occupancy was asked.
const ASSUMED_PER_SM: usize = 4;

/// The driver's resident blocks per SM of each matrix-vector kernel.
#[derive(Debug, Clone, Copy)]
struct MvPerSm {
    attn_in: usize,
    attn_out: usize,
    ffn_in: usize,
    ffn_out: usize,
    lm_head: usize,
    /// `moe_gu` (targets with routed experts; else the fallback)
    moe_gu: usize,
}

/// Resident blocks per SM of kernel `e` at `threads` a block (static shared memory only), as the
/// driver says; `fallback` where it does not answer.
fn resident_per_sm(kernels: &Kernels, e: abi::Entry, threads: u32, fallback: usize) -> usize {
    kernels
        .get(e)
        .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
        .map_or(fallback, |n| n as usize)
        .max(1)
}

/// Let each of `entries` launch with `smem` bytes of dynamic shared memory; false where the driver
/// refuses any.
fn allow_smem(kernels: &Kernels, entries: &[abi::Entry], smem: usize) -> bool {
    entries.iter().all(|&e| {
        kernels
            .get(e)
            .set_attribute(
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .is_ok()
    })
}

/// Give each of `entries` the dynamic shared memory its largest token tile needs: the most
/// `smem(n, f)` over `tiles` and the target's `formats`; false where the driver refuses.
fn tiles_ready(
    kernels: &Kernels,
    entries: &[abi::Entry],
    tiles: &[usize],
    formats: [WgFormat; 2],
    smem: fn(usize, WgFormat) -> usize,
) -> bool {
    let most = tiles
        .iter()
        .flat_map(|&n| formats.map(|f| smem(n, f)))
        .max()
        .unwrap_or(0);
    allow_smem(kernels, entries, most)
}

/// The Hopper GEMMs (`wg_*`) ready for their largest token tile (`layout::wg_smem_bytes`).
fn hopper_gemm_ready(kernels: &Kernels, formats: [WgFormat; 2]) -> bool {
    let entries = [
        abi::WgQkv::ID,
        abi::WgO::ID,
        abi::WgGu::ID,
        abi::WgDown::ID,
        abi::WgLogits::ID,
    ];
    let tiles = abi::layout::WG_TILES;
    tiles_ready(
        kernels,
        &entries,
        &tiles,
        formats,
        abi::layout::wg_smem_bytes,
    )
}

/// The warp-specialised GEMMs of quantized weights (`wq_*`) ready for their largest token tile
/// (`layout::wq_smem_bytes`).
fn wq_gemm_ready(kernels: &Kernels, formats: [WgFormat; 2]) -> bool {
    let entries = [
        abi::WqQkv::ID,
        abi::WqO::ID,
        abi::WqGu::ID,
        abi::WqDown::ID,
        abi::WqLogits::ID,
    ];
    let tiles = abi::layout::WQ_TILES;
    tiles_ready(
        kernels,
        &entries,
        &tiles,
        formats,
        abi::layout::wq_smem_bytes,
    )
}

/// The narrow GEMMs of q4_1 weights (`wn_*`) ready for the largest split their plans on
/// `sm_count` SMs stage (`plan::wn_plan` of each of the four layer products of `dims`).
fn wn_gemm_ready(kernels: &Kernels, dims: &metrale_core::shape::Dims, sm_count: usize) -> bool {
    let entries = [abi::WnQkv::ID, abi::WnO::ID, abi::WnGu::ID, abi::WnDown::ID];
    let products = [
        (dims.qd() + 2 * dims.kd(), dims.hidden),
        (dims.hidden, dims.qd()),
        (2 * dims.ffn, dims.hidden),
        (dims.hidden, dims.ffn),
    ];
    let f = WgFormat::Q4_1;
    products
        .iter()
        .all(|&(rows, k)| plan::wn_pays(f, rows, k, 1))
        && entries.iter().all(|&e| kernels.has(e))
        && allow_smem(
            kernels,
            &entries,
            products
                .iter()
                .map(|&(rows, k)| plan::wn_plan(rows, k, sm_count).smem as usize)
                .max()
                .unwrap_or(0),
        )
}

/// The routed experts' Hopper products (`moe_*_wg`, and with quantized weights `moe_*_wq`) ready
/// for their token tile of `GEMM_BM` pairs.
fn moe_wg_ready(kernels: &Kernels, f: WgFormat) -> bool {
    let n = abi::GEMM_BM as usize;
    kernels.has(abi::MoeGuWg::ID)
        && allow_smem(
            kernels,
            &[abi::MoeGuWg::ID, abi::MoeDownWg::ID],
            abi::layout::wg_smem_bytes(n, f),
        )
        && (f == WgFormat::Bf16
            || allow_smem(
                kernels,
                &[abi::MoeGuWq::ID, abi::MoeDownWq::ID],
                abi::layout::wq_smem_bytes(n, f),
            ))
}

/// Give each warp-specialised GEMM the dynamic shared memory its largest tile needs
/// (`layout::tma_smem_bytes`); false where the driver refuses.
fn tma_gemm_ready(kernels: &Kernels) -> bool {
    let smem = (0..abi::layout::TMA_CONFIGS.len())
        .map(abi::layout::tma_smem_bytes)
        .max()
        .unwrap_or(0);
    let entries = [
        abi::TmaQkv::ID,
        abi::TmaO::ID,
        abi::TmaGu::ID,
        abi::TmaDown::ID,
        abi::TmaLogits::ID,
    ];
    allow_smem(kernels, &entries, smem)
}

impl MvPerSm {
    fn query(kernels: &Kernels) -> MvPerSm {
        let per_sm = |e| resident_per_sm(kernels, e, abi::MV_THREADS, ASSUMED_PER_SM);
        MvPerSm {
            attn_in: per_sm(abi::AttnIn::ID),
            attn_out: per_sm(abi::AttnOut::ID),
            ffn_in: per_sm(abi::FfnIn::ID),
            ffn_out: per_sm(abi::FfnOut::ID),
            lm_head: per_sm(abi::LmHead::ID),
            moe_gu: if kernels.has(abi::MoeGu::ID) {
                per_sm(abi::MoeGu::ID)
            } else {
                ASSUMED_PER_SM
            },
        }
    }
}

/// A layer's routed experts as compiled (`[model.experts]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Experts per layer.
    pub experts: usize,
    /// Experts routed per token.
    pub used: usize,
    /// Each expert's FFN width.
    pub ffn: usize,
}

impl MoeShape {
    /// Whether a step of `ntok` tokens runs its experts grouped (`moe_sort`, the grouped
    /// products, `moe_combine`): from one pair an expert on average (16 tokens at 30B-A3B), where
    /// reading each expert's rows once for its tokens saves more than the sort, the splits and
    /// the combine cost (routers seldom spread evenly: most steps send several pairs to some
    /// experts); fewer tokens read each pair's expert rows for it (`moe_gu`, `moe_down`).
    pub fn grouped(&self, ntok: usize) -> bool {
        ntok * self.used >= self.experts
    }

    /// The most tiles `moe_sort` lists for `ntok` tokens: each expert's pairs in tiles of
    /// `GEMM_BM`, at most one partial tile an expert taken.
    pub fn tiles(&self, ntok: usize) -> usize {
        let pairs = ntok * self.used;
        pairs.div_ceil(abi::GEMM_BM as usize) + self.experts.min(pairs)
    }

    /// The routed experts of a target's model shape (`[model.experts]`), if it has them.
    pub fn of(m: &metrale_core::target::ModelShape) -> Option<MoeShape> {
        m.experts.as_ref().map(|x| MoeShape {
            experts: x.count as usize,
            used: x.used as usize,
            ffn: x.ffn as usize,
        })
    }
}

impl Deref for Gpu {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.dev
    }
}

impl Gpu {
    /// Open device `ordinal`, check its arch against the kernels' and load them.
    pub fn open(ordinal: usize, set: &KernelSet) -> Result<Gpu, BackendError> {
        let dev = Device::open(ordinal).map_err(|e| {
            BackendError::Device(format!(
                "{e}; this binary's kernels are built for {} ({})",
                set.arch, set.target
            ))
        })?;
        let kernels = Kernels::load(&dev, set)?;
        let sm90 = dev.cc.0 >= 9;
        let q = &set.spec.quant;
        let weights_bf16 = q.weights == "bf16";
        // (an unreadable dtype never gets here: `hopper_gemm` needs bf16 or q4_1 layers)
        let formats = [&q.weights, &q.embedding].map(|t| WgFormat::of(t).unwrap_or(WgFormat::Bf16));
        let hopper_gemm = set.arch == "sm_90a"
            && kernels.loaded_from == "cubin"
            && (weights_bf16 || q.gemm_activations == "f16")
            && hopper_gemm_ready(&kernels, formats);
        let tma_gemm = hopper_gemm && weights_bf16 && tma_gemm_ready(&kernels);
        let wq_gemm = hopper_gemm && !weights_bf16 && wq_gemm_ready(&kernels, formats);
        let dims = metrale_core::shape::Dims::from_shape(&set.spec.model);
        let wn_gemm = wq_gemm && wn_gemm_ready(&kernels, &dims, dev.sm_count);
        let flash_smem = abi::layout::flash_smem_bytes(set.spec.model.head_dim as usize);
        let flash_attention = set.spec.quant.kv == "bf16"
            && allow_smem(&kernels, &[abi::AttentionFlash::ID], flash_smem);
        let lm1_per_sm = resident_per_sm(&kernels, abi::LmHeadOne::ID, abi::MV_THREADS, 2);
        let att_per_sm = resident_per_sm(&kernels, abi::Attention::ID, abi::ATT_THREADS, 2);
        let mv_per_sm = MvPerSm::query(&kernels);
        let cluster_max = if sm90 {
            set.spec.hardware.attention_cluster.unwrap_or(0) as usize
        } else {
            0
        };
        let moe = MoeShape::of(&set.spec.model).filter(|_| kernels.has(abi::MoeRoute::ID));
        // attn_in_head where its grid is one wave: a head's blocks are one cluster, and a second
        // wave would wait a whole product behind the first (bf16 rows' registers hold 2 blocks an
        // SM: 264 of Qwen3-30B-A3B's 320 on an H100, so it runs attn_in + qkv_rope); and where a
        // warp's row pair is short enough to pay (`plan::attn_in_head_pays`)
        let attn_in_head = sm90
            && set.spec.quant.kv != "fp8"
            && kernels.has(abi::AttnInHead::ID)
            && plan::attn_in_head_pays(dims.hidden)
            && {
                let blocks = (dims.qd() + 2 * dims.kd()) / (2 * (abi::MV_THREADS / 32) as usize);
                resident_per_sm(&kernels, abi::AttnInHead::ID, abi::MV_THREADS, 0) * dev.sm_count
                    >= blocks
            };
        let moe_wg = hopper_gemm && moe.is_some() && moe_wg_ready(&kernels, formats[0]);
        Ok(Gpu {
            dims,
            moe,
            pdl: sm90,
            attention_heads: false,
            moe_route_fused: moe.is_some() && kernels.has(abi::MoeOutRoute::ID),
            attn_in_head,
            cluster_max,
            lm1_per_sm,
            mv_per_sm,
            lm_head_1: true,
            argmax_split: true,
            tma_96: true,
            att_flags: 0,
            att_pack: true,
            att_per_sm,
            moe_mma: true,
            moe_wg,
            hopper_gemm,
            tma_gemm,
            wq_gemm,
            wn_gemm,
            flash_attention,
            wg_layer: WgFormat::of(&q.weights),
            wg_head: WgFormat::of(&q.embedding),
            kernels,
            dev,
        })
    }

    /// The layer matrices are bf16 (else quantized).
    pub fn weights_bf16(&self) -> bool {
        self.wg_layer == Some(WgFormat::Bf16)
    }

    /// The Hopper GEMMs have an LM-head body (`wg_logits`, `wq_logits`): a bf16 head with bf16
    /// layers, or a q8_0 head with quantized layers (both take the layers' activation type).
    pub fn head_gemm(&self) -> bool {
        match (self.wg_layer, self.wg_head) {
            (Some(WgFormat::Bf16), Some(WgFormat::Bf16)) => true,
            (Some(l), Some(WgFormat::Q8_0)) => l != WgFormat::Bf16,
            _ => false,
        }
    }

    /// The Hopper GEMMs' format of the layer matrices and of the LM head (bf16 for a dtype they
    /// do not read: never launched then, `Gpu::hopper_gemm` and `Gpu::head_gemm` are off).
    fn layer_format(&self) -> WgFormat {
        self.wg_layer.unwrap_or(WgFormat::Bf16)
    }
    fn head_format(&self) -> WgFormat {
        self.wg_head.unwrap_or(WgFormat::Bf16)
    }

    /// How the modules were loaded: "cubin" or "ptx".
    pub fn loaded_from(&self) -> &'static str {
        self.kernels.loaded_from
    }

    /// Launch entry `A` with `args` on the stream, `A`'s declared block size and `how`.
    pub fn launch<A: KernelArgs>(
        &self,
        grid: (u32, u32, u32),
        how: LaunchHow,
        mut args: A,
    ) -> Result<(), BackendError> {
        let d = A::DECL;
        let f = self.kernels.get(A::ID);
        // SAFETY: `args` is entry A's argument struct: one field per parameter, in order, of the
        // declared types; the loaded kernel's signature was checked against that declaration
        // (`metrale_abi::check_ptx`) when it was built and again when its module was loaded.
        args.with_ptrs(|p| unsafe { self.dev.launch_raw(f, d.entry, grid, d.threads, how, p) })
    }

    /// The attributes of an ordinary launch (PDL where supported).
    fn plain(&self) -> LaunchHow {
        LaunchHow {
            pdl: self.pdl,
            ..LaunchHow::default()
        }
    }

    fn mv_grid(&self, row_pairs: usize, k: usize, ntok: i32, per_sm: usize) -> (u32, u32, u32) {
        plan::mv_grid(row_pairs, k, ntok as usize, self.sm_count, per_sm)
    }

    /// Token embedding of `a.ntok` tokens.
    pub fn embed(&self, a: abi::Embed) -> Result<(), BackendError> {
        self.launch((a.ntok as u32, 1, 1), self.plain(), a)
    }

    /// RMSNorm + QKV + RoPE + KV write of `a.ntok` tokens.
    pub fn attn_in(&self, a: abi::AttnIn) -> Result<(), BackendError> {
        let d = self.dims;
        let g = self.mv_grid(
            (d.qd() + 2 * d.kd()) / 2,
            d.hidden,
            a.ntok,
            self.mv_per_sm.attn_in,
        );
        self.launch(g, self.plain(), a)
    }

    /// Whether a chunk of `ntok` tokens takes its QKV product, the family's biases and head norms,
    /// RoPE and the KV write in one launch (`attn_in_head`) on the matrix-vector path: one token,
    /// where [`Gpu::attn_in_head`].
    pub fn qkv_head_fused(&self, ntok: usize) -> bool {
        self.attn_in_head && ntok == 1
    }

    /// One token's `attn_in` and `qkv_rope` as one launch: a warp a QKV row pair, a head's
    /// blocks one cluster.
    pub fn attn_in_head(&self, a: abi::AttnInHead) -> Result<(), BackendError> {
        let d = self.dims;
        let warps = (abi::MV_THREADS / 32) as usize;
        let how = LaunchHow {
            cluster_y: (d.head_dim / (2 * warps)) as u32,
            ..self.plain()
        };
        self.launch((1, ((d.qd() + 2 * d.kd()) / (2 * warps)) as u32, 1), how, a)
    }

    /// The Q/K/V biases, per-head Q/K RMSNorm, RoPE and KV write of `a.ntok` tokens' raw QKV rows
    /// (families with `features.qkv_rope`; the target's `qkv_rope` template).
    pub fn qkv_rope(&self, a: abi::QkvRope) -> Result<(), BackendError> {
        let d = self.dims;
        let warps = (abi::QKV_ROPE_THREADS / 32) as usize;
        let heads = (d.heads + 2 * d.kv_heads).div_ceil(warps);
        self.launch((a.ntok as u32, heads as u32, 1), self.plain(), a)
    }

    /// The routed experts of `a.ntok` tokens: norm, router, top-k (`moe_route`), a block per
    /// tile of `abi::MOE_ROUTE_TOKENS` tokens, each tile's router rows over
    /// [`Gpu::moe_router_blocks`] blocks.
    pub fn moe_route(&self, a: abi::MoeRoute) -> Result<(), BackendError> {
        let tiles = (a.ntok.max(0) as usize).div_ceil(abi::MOE_ROUTE_TOKENS as usize);
        let rb = self.moe_router_blocks(tiles);
        self.launch((tiles as u32, rb, 1), self.plain(), a)
    }

    /// Whether a chunk of `ntok` tokens routes from sums its O product leaves (`moe_out_route`,
    /// then `moe_gu` routing in every block, on the residual, and `moe_down` zeroing the sums):
    /// one token, on a target with routed experts and the kernel, its experts not grouped. The
    /// one test the forward pass asks at each of those three launches.
    pub fn route_fused(&self, ntok: usize) -> bool {
        self.moe_route_fused && ntok == 1 && !self.moe.is_some_and(|m| m.grouped(ntok))
    }

    /// One token's O product and residual add with its routing sums (`moe_out_route`), on
    /// `attn_out`'s grid ([`Gpu::moe_out_route_blocks`]).
    pub fn moe_out_route(&self, a: abi::MoeOutRoute) -> Result<(), BackendError> {
        let grid = (self.moe_out_route_blocks(), 1, 1);
        self.launch(grid, self.plain(), a)
    }

    /// `moe_out_route`'s blocks: `attn_out`'s grid for one token, at most 512 (the kernel clamps
    /// each block's share of the fixed-point sums so that 512 of them cannot overflow).
    pub fn moe_out_route_blocks(&self) -> u32 {
        let d = self.dims;
        self.mv_grid(d.hidden / 2, d.qd(), 1, self.mv_per_sm.attn_out)
            .0
            .min(512)
    }

    /// Blocks each of `tiles` tiles of tokens' router rows are spread over in `moe_route`: one
    /// while the tiles fill the GPU twice, else up to one expert a warp (a power of two), so that
    /// a tile's 128 rows of 2,048 f32 (1 MB at 30B-A3B) are not read by one SM alone.
    pub fn moe_router_blocks(&self, tiles: usize) -> u32 {
        let Some(m) = self.moe else { return 1 };
        let most = (m.experts / (abi::MV_THREADS as usize / 32)).max(1);
        let want = (2 * self.sm_count / tiles.max(1)).clamp(1, most);
        1 << want.ilog2()
    }

    /// The blocks a routed product gives each of its `items` (pairs or tokens) over `row_pairs` row
    /// pairs: one warp per row pair while the grid stays within one wave of `per_sm` blocks an SM
    /// (the kernel's occupancy), fewer (warps loop) beyond.
    fn moe_blocks(&self, row_pairs: usize, items: usize, per_sm: usize) -> u32 {
        let most = row_pairs.div_ceil(abi::MV_THREADS as usize / 32);
        let wave = per_sm * self.sm_count / items.max(1);
        most.min(wave).max(1) as u32
    }

    /// Every routed (token, expert) pair's gate/up and SiLU (`moe_gu`).
    pub fn moe_gu(&self, a: abi::MoeGu) -> Result<(), BackendError> {
        let m = self.moe.expect("moe_gu on a target with routed experts");
        let pairs = a.ntok.max(0) as usize * m.used;
        let gx = self.moe_blocks(m.ffn, pairs, self.mv_per_sm.moe_gu);
        self.launch((pairs as u32, gx, 1), self.plain(), a)
    }

    /// Every token's experts' down products, weighted, into the residual (`moe_down`). A block
    /// takes its share of the row pairs four at a time (the kernel's `DOWN_PAIRS`), each pair's
    /// experts on different warps, so the grid is a block per four row pairs while it stays within
    /// a few waves (the kernel is correct for any count; this one is what it was made for).
    pub fn moe_down(&self, a: abi::MoeDown) -> Result<(), BackendError> {
        let n = a.ntok.max(0) as usize;
        let wave = 4 * self.sm_count / n.max(1);
        let gx = (self.dims.hidden / 2).div_ceil(4).min(wave).max(1) as u32;
        self.launch((n as u32, gx, 1), self.plain(), a)
    }

    /// `a.ntok` tokens' routed pairs grouped by expert (`moe_sort`, one block).
    pub fn moe_sort(&self, a: abi::MoeSort) -> Result<(), BackendError> {
        self.launch((1, 1, 1), self.plain(), a)
    }

    /// Every expert's gate/up and SiLU over its pairs (`moe_gu_grouped`, after `moe_sort`).
    pub fn moe_gu_grouped(&self, a: abi::MoeGuGrouped) -> Result<(), BackendError> {
        let m = self
            .moe
            .expect("moe_gu_grouped on a target with routed experts");
        let gx = self.moe_blocks(m.ffn, m.experts, ASSUMED_PER_SM);
        self.launch((gx, m.experts as u32, 1), self.plain(), a)
    }

    /// Every expert's down products over its pairs, unweighted (`moe_down_grouped`).
    pub fn moe_down_grouped(&self, a: abi::MoeDownGrouped) -> Result<(), BackendError> {
        let m = self
            .moe
            .expect("moe_down_grouped on a target with routed experts");
        let gx = self.moe_blocks(self.dims.hidden / 2, m.experts, ASSUMED_PER_SM);
        self.launch((gx, m.experts as u32, 1), self.plain(), a)
    }

    /// `a.ntok` rows of the routed experts' normed input split for `moe_gu_mma` (`moe_split_x`).
    pub fn moe_split_x(&self, a: abi::MoeSplitX) -> Result<(), BackendError> {
        self.launch(plan::split_grid(a.ntok.max(0) as usize), self.plain(), a)
    }

    /// The `a.ntok * used` pairs' SiLU(gate) * up rows split for `moe_down_mma` (`moe_split_h`).
    pub fn moe_split_h(&self, a: abi::MoeSplitH) -> Result<(), BackendError> {
        let m = self
            .moe
            .expect("moe_split_h on a target with routed experts");
        self.launch(
            plan::split_grid(a.ntok.max(0) as usize * m.used),
            self.plain(),
            a,
        )
    }

    /// Every expert's gate/up and SiLU over its pairs on the tensor cores (`moe_gu_mma`).
    pub fn moe_gu_mma(&self, a: abi::MoeGuMma) -> Result<(), BackendError> {
        let m = self
            .moe
            .expect("moe_gu_mma on a target with routed experts");
        let gx = 2 * m.ffn / abi::GEMM_BN as usize;
        let gy = m.tiles(a.ntok.max(0) as usize);
        self.launch((gx as u32, gy as u32, 1), self.plain(), a)
    }

    /// Every expert's down products over its pairs on the tensor cores, unweighted (`moe_down_mma`).
    pub fn moe_down_mma(&self, a: abi::MoeDownMma) -> Result<(), BackendError> {
        let m = self
            .moe
            .expect("moe_down_mma on a target with routed experts");
        let gx = self.dims.hidden / abi::GEMM_BN as usize;
        let gy = m.tiles(a.ntok.max(0) as usize);
        self.launch((gx as u32, gy as u32, 1), self.plain(), a)
    }

    /// Every expert's gate/up and SiLU over its pairs on Hopper's wgmma (`moe_gu_wg`, or with
    /// `warp_specialised` its twin `moe_gu_wq`; [`Gpu::moe_wg`]): `a.a` holds the tokens' normed
    /// input in the GEMMs' 16-bit type (`wg_act_head`), `a.h` gets the pairs' rows in it.
    pub fn moe_gu_wg(&self, a: abi::MoeGuWg, warp_specialised: bool) -> Result<(), BackendError> {
        let m = self.moe.expect("moe_gu_wg on a target with routed experts");
        self.moe_wg_launch::<_, abi::MoeGuWq>(2 * m.ffn, a.ntok, warp_specialised, a)
    }

    /// Every expert's down products over its pairs' `h` on Hopper's wgmma, unweighted
    /// (`moe_down_wg`, or its twin `moe_down_wq`).
    pub fn moe_down_wg(
        &self,
        a: abi::MoeDownWg,
        warp_specialised: bool,
    ) -> Result<(), BackendError> {
        self.moe_wg_launch::<_, abi::MoeDownWq>(self.dims.hidden, a.ntok, warp_specialised, a)
    }

    /// A grouped product of the routed experts on Hopper (`moe.cu.hbs`'s `moe_*_wg` or, warp
    /// specialised, `moe_*_wq`): a block per (tile of `moe_sort`'s list for `ntok` tokens,
    /// weight-row tile of an expert's `rows`), the dense products' shared memory at a token
    /// tile of `GEMM_BM`.
    fn moe_wg_launch<G: KernelArgs, Q: KernelArgs + From<G>>(
        &self,
        rows: usize,
        ntok: i32,
        warp_specialised: bool,
        a: G,
    ) -> Result<(), BackendError> {
        let m = self
            .moe
            .expect("a routed experts' product on a target with them");
        let (n, f) = (abi::GEMM_BM as usize, self.layer_format());
        let tiles = m.tiles(ntok.max(0) as usize) as u32;
        if warp_specialised {
            let how = LaunchHow {
                smem: abi::layout::wq_smem_bytes(n, f) as u32,
                ..self.plain()
            };
            let gy = rows / abi::WQ_ROWS as usize;
            return self.launch((tiles, gy as u32, 1), how, Q::from(a));
        }
        let how = LaunchHow {
            smem: abi::layout::wg_smem_bytes(n, f) as u32,
            ..self.plain()
        };
        let gy = rows / abi::layout::wg_rows(n);
        self.launch((tiles, gy as u32, 1), how, a)
    }

    /// Each token's pairs' down outputs, weighted, into the residual (`moe_combine`).
    pub fn moe_combine(&self, a: abi::MoeCombine) -> Result<(), BackendError> {
        self.launch((a.ntok.max(0) as u32, 1, 1), self.plain(), a)
    }

    /// Whether the target's QKV products leave raw rows for `qkv_rope` (its family adds Q/K/V
    /// biases or norms each Q/K head: `features.qkv_rope`; its kernels hold that template).
    pub fn raw_qkv(&self) -> bool {
        self.kernels.has(abi::QkvRope::ID)
    }

    /// `attention`'s flag bits packing the pairs of a launch of `ntok` tokens in `nsplit` splits
    /// ([`plan::attention_pack`]; none where [`Gpu::att_pack`] is off).
    pub fn att_pack_flags(&self, ntok: usize, nsplit: usize) -> i32 {
        if !self.att_pack {
            return 0;
        }
        let p = plan::attention_pack(
            self.dims.kv_heads,
            ntok,
            nsplit,
            self.sm_count,
            self.att_per_sm,
        );
        (p << abi::ATT_PACK_SHIFT) as i32
    }

    /// Split-K attention of `ntok` tokens in `a.nsplit` splits (one cluster per (KV head, token)
    /// where the target allows it), several (token, KV head) pairs a block where `a.flags` packs
    /// them (one split only); `a.counter` holds `ntok * kv_heads` zeroed tickets (times
    /// `layout::att_head_blocks` with `heads_split`).
    /// `heads_split`: on `attention_hs`, each block a part of the group's query heads
    /// (`layout::att_head_blocks` blocks a (token, KV head, split); one pair a block).
    pub fn attention(
        &self,
        a: abi::Attention,
        ntok: usize,
        heads_split: bool,
    ) -> Result<(), BackendError> {
        let pack = (a.flags as u32 >> abi::ATT_PACK_SHIFT) & 3;
        let kv = self.dims.kv_heads as u32;
        if pack > 0 && (a.nsplit != 1 || !kv.is_multiple_of(1 << pack) || heads_split) {
            return Err(BackendError::Invalid(format!(
                "attention: {} pairs a block need one split, a divisor of the {kv} KV heads and \
                 every query head of the group a block (asked: {} splits, heads split: \
                 {heads_split})",
                1 << pack,
                a.nsplit
            )));
        }
        let how = LaunchHow {
            cluster_y: plan::attention_cluster(a.nsplit as usize, self.cluster_max),
            ..self.plain()
        };
        if heads_split {
            let hb = abi::layout::att_head_blocks(self.dims.group()) as u32;
            let a: abi::AttentionHs = a.into();
            return self.launch((kv, a.nsplit as u32, ntok as u32 * hb), how, a);
        }
        self.launch((kv >> pack, a.nsplit as u32, ntok as u32), how, a)
    }

    /// Whether a split-K attention launch of `ntok` tokens over `nsplit` splits runs on
    /// `attention_hs`: the target's kernels have it and split a group's query heads over several
    /// blocks, the launch packs no pairs into a block ([`Gpu::att_pack_flags`]), and it is too
    /// small to fill half the SMs with a block a (token, KV head, split) (`Gpu::attention_heads`,
    /// a tuning).
    pub fn attention_heads_pay(&self, ntok: usize, nsplit: usize) -> bool {
        let d = self.dims;
        self.attention_heads
            && self.att_pack_flags(ntok, nsplit) == 0
            && self.kernels.has(abi::AttentionHs::ID)
            && abi::layout::att_head_blocks(d.group()) > 1
            && 2 * ntok * d.kv_heads * nsplit < self.sm_count
    }

    /// Flash attention of the `ntiles` query tiles in `a.tiles` (`abi::AttentionFlash`).
    pub fn attention_flash(
        &self,
        a: abi::AttentionFlash,
        ntiles: usize,
    ) -> Result<(), BackendError> {
        let grid = (ntiles as u32, self.dims.kv_heads as u32, 1);
        let how = LaunchHow {
            smem: abi::layout::flash_smem_bytes(self.dims.head_dim) as u32,
            ..self.plain()
        };
        self.launch(grid, how, a)
    }

    /// Output projection + residual.
    pub fn attn_out(&self, a: abi::AttnOut) -> Result<(), BackendError> {
        let d = self.dims;
        self.launch(
            self.mv_grid(d.hidden / 2, d.qd(), a.ntok, self.mv_per_sm.attn_out),
            self.plain(),
            a,
        )
    }

    /// RMSNorm + gate/up + SiLU.
    pub fn ffn_in(&self, a: abi::FfnIn) -> Result<(), BackendError> {
        let d = self.dims;
        self.launch(
            self.mv_grid(d.ffn, d.hidden, a.ntok, self.mv_per_sm.ffn_in),
            self.plain(),
            a,
        )
    }

    /// Down projection + residual.
    pub fn ffn_out(&self, a: abi::FfnOut) -> Result<(), BackendError> {
        let d = self.dims;
        self.launch(
            self.mv_grid(d.hidden / 2, d.ffn, a.ntok, self.mv_per_sm.ffn_out),
            self.plain(),
            a,
        )
    }

    /// Final norm + LM head of `a.ntok` selected rows with the fused greedy pick (`lm_head_1` for one
    /// row, the batch-1 decode path). `a.part` and `a.counter` are sized by
    /// [`Gpu::lm_head_scratch`]; the counters are zero between launches.
    pub fn lm_head(&self, a: abi::LmHead) -> Result<(), BackendError> {
        if a.ntok == 1 && self.lm_head_1 {
            let grid = (
                plan::lm_head1_blocks(self.dims.vocab, self.sm_count, self.lm1_per_sm),
                1,
                1,
            );
            let one = abi::LmHeadOne {
                x: a.x,
                sel: a.sel,
                norm_w: a.norm_w,
                wqs: a.wqs,
                wsc: a.wsc,
                logits: a.logits,
                ntok: a.ntok,
                part: a.part,
                counter: a.counter,
                out_tok: a.out_tok,
                out_logprob: a.out_logprob,
            };
            return self.launch(grid, self.plain(), one);
        }
        let d = self.dims;
        self.launch(
            self.mv_grid(d.vocab / 2, d.hidden, a.ntok, self.mv_per_sm.lm_head),
            self.plain(),
            a,
        )
    }

    /// Bytes of the `part` buffer `lm_head` and `argmax` need for up to `nout` outputs (one
    /// `mt::Acc` per block and output), and of their counters (one u32 per token tile or row).
    pub fn lm_head_scratch(&self, nout: usize) -> (usize, usize) {
        let d = self.dims;
        let (gx, gy, _) = plan::mv_grid(
            d.vocab / 2,
            d.hidden,
            nout,
            self.sm_count,
            self.mv_per_sm.lm_head,
        );
        let gx = (gx as usize)
            .max(plan::lm_head1_blocks(d.vocab, self.sm_count, self.lm1_per_sm) as usize);
        let (argmax_part, argmax_counters) = self.argmax_scratch(nout);
        (
            (nout.max(1) * gx * abi::ACC_BYTES as usize).max(argmax_part),
            (gy.max(1) as usize * 4).max(argmax_counters),
        )
    }

    /// Arg-max and logprob of `a.ntok` logits rows; `a.part` and `a.counter` sized by
    /// [`Gpu::argmax_scratch`] (the LM head's scratch, [`Gpu::lm_head_scratch`], holds them).
    pub fn argmax(&self, a: abi::ArgmaxLogprob) -> Result<(), BackendError> {
        self.argmax_with(a, self.argmax_split)
    }

    /// [`Gpu::argmax`] with each row over `plan::argmax_splits` blocks (`split`) or one.
    pub fn argmax_with(&self, a: abi::ArgmaxLogprob, split: bool) -> Result<(), BackendError> {
        let splits = if split {
            plan::argmax_splits(a.ntok as usize, self.dims.vocab, self.sm_count)
        } else {
            1
        };
        self.launch((splits, a.ntok.max(1) as u32, 1), self.plain(), a)
    }

    /// Bytes of the `part` and `counter` buffers [`Gpu::argmax`] needs for up to `nout` rows (one
    /// `mt::Acc` per block, one ticket per row; the counters zero between launches).
    pub fn argmax_scratch(&self, nout: usize) -> (usize, usize) {
        let nout = nout.max(1);
        let splits = (1..=nout)
            .map(|n| n * plan::argmax_splits(n, self.dims.vocab, self.sm_count) as usize)
            .max()
            .unwrap_or(1);
        (splits * abi::ACC_BYTES as usize, nout * 4)
    }

    /// Grammar masks applied in place to `a.nout` logits rows.
    pub fn mask_logits(&self, a: abi::MaskLogits) -> Result<(), BackendError> {
        let grid = plan::mask_grid(a.nout as usize, self.dims.vocab);
        self.launch(grid, self.plain(), a)
    }

    /// One row's arg-max under its grammar mask, spread over the row's blocks; `part` must hold
    /// one `abi::ACC_BYTES` partial per block (`plan::row_blocks`).
    pub fn argmax_masked_1(&self, a: abi::ArgmaxMaskedOne) -> Result<(), BackendError> {
        let grid = (plan::row_blocks(self.dims.vocab), 1, 1);
        self.launch(grid, self.plain(), a)
    }

    /// Seeded sampling of `a.nout` logits rows.
    pub fn sample_probs(&self, a: abi::SampleProbs) -> Result<(), BackendError> {
        self.launch((a.nout as u32, 1, 1), self.plain(), a)
    }

    /// Get `decode_1` ready for `smem` bytes of dynamic shared memory per block: its resident blocks
    /// per SM and resources; `None` when the device cannot give a block that much shared memory.
    pub fn decode1_prepare(&self, smem: usize) -> Result<Option<Occupancy>, BackendError> {
        if !self.kernels.has(abi::DecodeOne::ID)
            || !allow_smem(&self.kernels, &[abi::DecodeOne::ID], smem)
        {
            return Ok(None);
        }
        let f = self.kernels.get(abi::DecodeOne::ID);
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(abi::DECODE_THREADS, smem, None)
            .map_err(dev_err("decode_1 occupancy"))?;
        Ok(Some(Occupancy {
            per_sm,
            regs: f
                .get_attribute(Attr::CU_FUNC_ATTRIBUTE_NUM_REGS)
                .unwrap_or(-1),
            local_bytes: f
                .get_attribute(Attr::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
                .unwrap_or(-1),
        }))
    }

    /// `decode_1` as a cooperative grid of `blocks` blocks (all co-resident, or the launch fails)
    /// with `smem` bytes of dynamic shared memory.
    pub fn decode_1(&self, blocks: u32, smem: u32, a: abi::DecodeOne) -> Result<(), BackendError> {
        let how = LaunchHow {
            cooperative: true,
            smem,
            ..LaunchHow::default()
        };
        self.launch((blocks, 1, 1), how, a)
    }

    /// GEMM path: RMSNorm(x) split into f16 hi/lo and block sums.
    pub fn norm_split(&self, a: abi::NormSplit) -> Result<(), BackendError> {
        self.launch(plan::split_grid(a.ntok as usize), self.plain(), a)
    }

    /// GEMM path: the attention output split.
    pub fn split_qd(&self, a: abi::SplitQd) -> Result<(), BackendError> {
        self.launch(plan::split_grid(a.ntok as usize), self.plain(), a)
    }

    /// GEMM path: the FFN activation split.
    pub fn split_ffn(&self, a: abi::SplitFfn) -> Result<(), BackendError> {
        self.launch(plan::split_grid(a.ntok as usize), self.plain(), a)
    }

    /// GEMM path: QKV projection + RoPE + KV write.
    pub fn gemm_qkv(&self, a: abi::GemmQkv) -> Result<(), BackendError> {
        let d = self.dims;
        let g = plan::gemm_grid(d.qd() + 2 * d.kd(), a.ntok as usize);
        self.launch(g, self.plain(), a)
    }

    /// GEMM path: output projection + residual.
    pub fn gemm_o(&self, a: abi::GemmO) -> Result<(), BackendError> {
        let g = plan::gemm_grid(self.dims.hidden, a.ntok as usize);
        self.launch(g, self.plain(), a)
    }

    /// GEMM path: gate/up + SiLU.
    pub fn gemm_gu(&self, a: abi::GemmGu) -> Result<(), BackendError> {
        let g = plan::gemm_grid(2 * self.dims.ffn, a.ntok as usize);
        self.launch(g, self.plain(), a)
    }

    /// GEMM path: down projection + residual.
    pub fn gemm_down(&self, a: abi::GemmDown) -> Result<(), BackendError> {
        let g = plan::gemm_grid(self.dims.hidden, a.ntok as usize);
        self.launch(g, self.plain(), a)
    }

    /// Hopper GEMM path: bf16(RMSNorm(x)).
    pub fn wg_act_norm(&self, a: abi::WgActNorm) -> Result<(), BackendError> {
        self.launch((a.ntok.max(1) as u32, 1, 1), self.plain(), a)
    }

    /// A Hopper GEMM of `rows` output rows and row length `k` over `a`'s `ntok` tokens in format
    /// `f`: on the narrow kernel `W` where [`Gpu::wn_gemm`] and `plan::wn_pays` (`plan::wn_plan`),
    /// else on the warp-specialised kernel `Q` where [`Gpu::wq_gemm`] and `plan::wq_pays`
    /// (`plan::wq_plan`), else on `G`'s one-warpgroup kernel (`plan::wg_plan`); the arguments carry
    /// the token tile the plan chose.
    fn hopper_launch<G: Tiled, Q: Tiled + From<G>, W: Tiled + From<G>>(
        &self,
        rows: usize,
        k: usize,
        ntok: i32,
        f: abi::layout::WgFormat,
        a: G,
    ) -> Result<(), BackendError> {
        let ntok = ntok.max(0) as usize;
        if self.wn_gemm && plan::wn_pays(f, rows, k, ntok) {
            return self.launch_planned(plan::wn_plan(rows, k, self.sm_count), W::from(a));
        }
        if self.wq_gemm && plan::wq_pays(f, rows, ntok) {
            let p = plan::wq_plan(rows, k, ntok, self.sm_count, f);
            return self.launch_planned(p, Q::from(a));
        }
        self.launch_planned(plan::wg_plan(rows, k, ntok, self.sm_count, f), a)
    }

    /// Launch a Hopper GEMM as plan `p` says: its grid, its dynamic shared memory, its token tile
    /// in the arguments.
    fn launch_planned<A: Tiled>(&self, p: plan::WgPlan, mut a: A) -> Result<(), BackendError> {
        a.set_tile(p.tile_n as i32);
        let how = LaunchHow {
            smem: p.smem,
            ..self.plain()
        };
        self.launch(p.grid, how, a)
    }

    /// Hopper GEMM path: QKV projection + RoPE + KV write.
    pub fn wg_qkv(&self, a: abi::WgQkv) -> Result<(), BackendError> {
        let d = self.dims;
        self.hopper_launch::<_, abi::WqQkv, abi::WnQkv>(
            d.qd() + 2 * d.kd(),
            d.hidden,
            a.ntok,
            self.layer_format(),
            a,
        )
    }

    /// Hopper GEMM path: output projection + residual.
    pub fn wg_o(&self, a: abi::WgO) -> Result<(), BackendError> {
        let d = self.dims;
        self.hopper_launch::<_, abi::WqO, abi::WnO>(
            d.hidden,
            d.qd(),
            a.ntok,
            self.layer_format(),
            a,
        )
    }

    /// Hopper GEMM path: gate/up + SiLU.
    pub fn wg_gu(&self, a: abi::WgGu) -> Result<(), BackendError> {
        let d = self.dims;
        self.hopper_launch::<_, abi::WqGu, abi::WnGu>(
            2 * d.ffn,
            d.hidden,
            a.ntok,
            self.layer_format(),
            a,
        )
    }

    /// Hopper GEMM path: down projection + residual.
    pub fn wg_down(&self, a: abi::WgDown) -> Result<(), BackendError> {
        let d = self.dims;
        self.hopper_launch::<_, abi::WqDown, abi::WnDown>(
            d.hidden,
            d.ffn,
            a.ntok,
            self.layer_format(),
            a,
        )
    }

    /// Hopper GEMM path: bf16(RMSNorm(x[sel])), the LM head's input.
    pub fn wg_act_head(&self, a: abi::WgActHead) -> Result<(), BackendError> {
        self.launch((a.ntok.max(1) as u32, 1, 1), self.plain(), a)
    }

    /// Hopper GEMM path: the LM head's logits.
    pub fn wg_logits(&self, a: abi::WgLogits) -> Result<(), BackendError> {
        let d = self.dims;
        // (no narrow head: `plan::wn_pays` takes q4_1 layers only)
        self.hopper_launch::<_, abi::WqLogits, abi::WqLogits>(
            d.vocab,
            d.hidden,
            a.ntok,
            self.head_format(),
            a,
        )
    }

    /// A warp-specialised GEMM (`tma_*`) as `p` plans it (`plan::tma_plan`); the arguments carry
    /// its `cfg` and `splits`.
    pub fn tma_gemm<A: KernelArgs>(&self, p: &plan::TmaPlan, a: A) -> Result<(), BackendError> {
        let how = LaunchHow {
            smem: p.smem,
            ..self.plain()
        };
        self.launch((p.blocks, 1, 1), how, a)
    }
}

#[cfg(test)]
mod tests {
    use super::MoeShape;

    #[test]
    fn experts_group_from_one_pair_an_expert() {
        // Qwen3-30B-A3B: 128 experts, 8 a token; up to 15 sequences read per pair
        let m = MoeShape {
            experts: 128,
            used: 8,
            ffn: 768,
        };
        assert!(!m.grouped(1) && !m.grouped(8) && !m.grouped(15));
        assert!(m.grouped(16) && m.grouped(256) && m.grouped(512));
        // the work list: 16 tokens' 128 pairs in at most 4 whole tiles and one partial a taken
        // expert; 512 tokens' 4,096 pairs: 128 tiles + 128
        assert_eq!((m.tiles(1), m.tiles(16), m.tiles(512)), (9, 132, 256));
    }
}
