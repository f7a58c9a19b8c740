//! The per-stage forward pass of one chunk: the activation and I/O buffers (allocated once, for
//! `max_step_tokens`) and the launch sequence over them: `embed`, then per layer `attn_in` (RMSNorm,
//! QKV, RoPE, KV write), `attention` (split-K GQA; prompt chunks on bf16-KV targets:
//! `attention_flash`, tensor-core flash attention over query tiles, [`Attn`]), `attn_out` (O projection and residual), `ffn_in`
//! (RMSNorm, gate/up, SiLU), `ffn_out` (down projection and residual), then `lm_head` (final norm
//! and LM head on each sequence's last token, with the greedy pick fused): 2 + 5 x layers launches
//! (6 a layer for families with Q/K/V biases or a per-head Q/K norm: the QKV product leaves raw
//! rows in [`Bufs::qkv`] and `qkv_rope` adds, norms, rotates and writes them),
//! the four layer products as tensor-core GEMMs (`gemm`) for chunks where they pay, and, on the
//! Hopper path, the LM head of several outputs as a GEMM followed by `argmax_logprob`.
//!
//! Invariants: a chunk's inputs reach the kernels only through the fixed token/pos/slot/sel
//! buffers (so a captured graph replays any decode step of its shape); the attention tickets and
//! the LM head's counters are zero between launches (the kernels re-arm them).

use metrale_abi as abi;
use metrale_core::BackendError;

use super::device::DevBuf;
use super::gemm::{GemmPath, QkvOut};
use super::launch::{Gpu, MoeShape};
use super::plan;
use super::CudaBackend;
pub(super) use crate::stage::Stage;

/// Activation and I/O buffers, sized once.
pub(super) struct Bufs {
    pub x: DevBuf,
    pub q: DevBuf,
    /// families with `features.qkv_rope`: the QKV product's raw rows `[maxt][qd + 2 kd]`, which
    /// `qkv_rope` adds the biases to, norms, rotates and writes to `q` and the KV cache
    pub qkv: Option<DevBuf>,
    /// families with routed experts ([`MoeBufs`])
    pub moe: Option<MoeBufs>,
    pub h: DevBuf,
    pub part_ml: DevBuf,
    pub part_acc: DevBuf,
    /// attention output `[maxt][qd]`
    pub att: DevBuf,
    /// the split-combine tickets `[maxt][kv_heads][layout::att_head_blocks]` (zero between
    /// launches)
    pub att_counter: DevBuf,
    pub logits: DevBuf,
    /// i32 inputs, one copy per chunk: tokens[maxt] | pos[maxt] | slot[maxt] | sel[slots] |
    /// tiles[maxt][2] (`attention_flash`'s query tiles, [`io_words`])
    pub io_in: DevBuf,
    pub tokens: u64,
    pub pos: u64,
    pub slot: u64,
    pub sel: u64,
    pub tiles: u64,
    /// outputs, one copy back: out_tok[slots] (i32) | out_lp[slots] (f32)
    pub io_out: DevBuf,
    pub out_tok: u64,
    pub out_lp: u64,
    /// lm_head's and argmax's per-block greedy partials and their tickets (zero between launches)
    pub lm_part: DevBuf,
    pub lm_counter: DevBuf,
    /// sample_probs: parameters in, (token | logprob | status) out, one row per output
    pub samp_params: DevBuf,
    pub samp_out: DevBuf,
    /// grammar masks, one staged copy per step (`mask_words`): each output's mask row or -1,
    /// then the constrained outputs' rows (`ceil(vocab / 32)` words each); and the greedy choice
    /// under the masks (token | logprob), one per output
    pub masks: DevBuf,
    pub mask_out: DevBuf,
}

impl Bufs {
    /// Buffers for chunks of up to `maxt` tokens and `nout` outputs per chunk.
    pub fn new(gpu: &Gpu, maxt: usize, nout: usize) -> Result<Bufs, BackendError> {
        let d = gpu.dims;
        let f = 4usize;
        let io_in = gpu.alloc(io_words(maxt, nout) * 4)?;
        let io_out = gpu.alloc(2 * nout * 4)?;
        let (part_bytes, counter_bytes) = gpu.lm_head_scratch(nout);
        Ok(Bufs {
            x: gpu.alloc(maxt * d.hidden * f)?,
            q: gpu.alloc(maxt * d.qd() * f)?,
            qkv: match gpu.raw_qkv() {
                true => Some(gpu.alloc(maxt * (d.qd() + 2 * d.kd()) * f)?),
                false => None,
            },
            moe: match gpu.moe {
                Some(m) => Some(MoeBufs {
                    xn: gpu.alloc(maxt * d.hidden * f)?,
                    ids: gpu.alloc(maxt * m.used * 4)?,
                    wts: gpu.alloc(maxt * m.used * 4)?,
                    h: gpu.alloc(maxt * m.used * m.ffn * f)?,
                    counts: gpu.alloc(d.layers * m.experts * 4)?,
                    logits: gpu.alloc(maxt * m.experts * 4)?,
                    ticket: gpu.alloc(maxt * 4)?,
                    route_acc: gpu.alloc((m.experts + 1) * 8)?,
                    grouped: match m.grouped(maxt) {
                        true => Some(MoeGrouped {
                            offsets: gpu.alloc((m.experts + 1) * 4)?,
                            order: gpu.alloc(maxt * m.used * 4)?,
                            y: gpu.alloc(maxt * m.used * d.hidden * f)?,
                            products: MoeProducts::new(gpu, maxt, m, d.hidden)?,
                        }),
                        false => None,
                    },
                }),
                None => None,
            },
            h: gpu.alloc(maxt * d.ffn * f)?,
            part_ml: gpu.alloc(maxt * d.heads * plan::MAX_SPLITS * 8)?,
            part_acc: gpu.alloc(maxt * d.heads * plan::MAX_SPLITS * d.head_dim * f)?,
            att: gpu.alloc(maxt * d.qd() * f)?,
            att_counter: gpu
                .alloc(maxt * d.kv_heads * abi::layout::att_head_blocks(d.group()) * 4)?,
            logits: gpu.alloc(nout * d.vocab * f)?,
            tokens: io_in.ptr,
            pos: io_in.ptr + (maxt * 4) as u64,
            slot: io_in.ptr + (2 * maxt * 4) as u64,
            sel: io_in.ptr + (3 * maxt * 4) as u64,
            tiles: io_in.ptr + ((3 * maxt + nout) * 4) as u64,
            io_in,
            out_tok: io_out.ptr,
            out_lp: io_out.ptr + (nout * 4) as u64,
            io_out,
            lm_part: gpu.alloc(part_bytes)?,
            lm_counter: gpu.alloc(counter_bytes)?,
            samp_params: gpu.alloc(nout * std::mem::size_of::<abi::device::SampleParams>())?,
            samp_out: gpu.alloc(3 * nout * 4)?,
            masks: gpu.alloc(mask_words(nout, d.vocab) * 4)?,
            mask_out: gpu.alloc(2 * nout * 4)?,
        })
    }
}

/// The routed experts' buffers: the normed input `xn[maxt][hidden]`, each token's experts and
/// weights `ids` / `wts` `[maxt][used]`, and each (token, expert) pair's SiLU(gate) * up
/// `h[maxt * used][expert ffn]` (f32; in the GEMMs' 16-bit type where a chunk's products run on
/// Hopper, [`MoeProducts::Wg`]).
pub struct MoeBufs {
    pub xn: DevBuf,
    pub ids: DevBuf,
    pub wts: DevBuf,
    pub h: DevBuf,
    /// How often each layer's router chose each expert since the backend started or the counts
    /// were last cleared: u32 `[layers][experts]` (`CudaBackend::expert_counts`).
    pub counts: DevBuf,
    /// `moe_route`'s router logits `[maxt][experts]` (f32) and tickets `[maxt]` (u32, zero
    /// between launches) where a token's router rows are spread over several blocks.
    pub logits: DevBuf,
    pub ticket: DevBuf,
    /// `moe_out_route`'s sums of a token's router logits and of its squares, `[experts + 1]`
    /// (u64, fixed point; zero between layers: `moe_down` zeroes them).
    pub route_acc: DevBuf,
    /// Where chunks can be large enough to group their pairs by expert (`MoeShape::grouped`).
    pub grouped: Option<MoeGrouped>,
}

/// The grouped experts' buffers: `moe_sort`'s `offsets[experts + 1]` and `order[maxt * used]`,
/// and each pair's down output `y[maxt * used][hidden]` (f32) before `moe_combine` weighs it.
pub struct MoeGrouped {
    pub offsets: DevBuf,
    pub order: DevBuf,
    pub y: DevBuf,
    /// Which kernels run the grouped products, and their buffers.
    pub products: MoeProducts,
}

/// The kernels of the grouped experts' products.
pub enum MoeProducts {
    /// `moe_gu_grouped` / `moe_down_grouped` (CUDA cores).
    Cores,
    /// `moe_gu_mma` / `moe_down_mma` (mma.sync over split activations, [`Gpu::moe_mma`]).
    Mma(MoeSplit),
    /// `moe_gu_wg` / `moe_down_wg` or their warp-specialised twins (Hopper's wgmma,
    /// [`Gpu::moe_wg`]): the tokens' normed input in the GEMMs' 16-bit type `[maxt][hidden]`
    /// (`wg_act_head`), and `moe_sort`'s work list (`MoeShape::tiles`). The pairs' `h` rows
    /// go in the same type into [`MoeBufs::h`].
    Wg { a: DevBuf, tiles: DevBuf },
}

impl MoeProducts {
    /// The products `gpu` runs for chunks of up to `maxt` tokens.
    pub fn new(
        gpu: &Gpu,
        maxt: usize,
        m: MoeShape,
        hidden: usize,
    ) -> Result<MoeProducts, BackendError> {
        Ok(if gpu.moe_wg {
            MoeProducts::Wg {
                a: gpu.alloc(maxt * hidden * 2)?,
                tiles: gpu.alloc((1 + 2 * m.tiles(maxt)) * 4)?,
            }
        } else if gpu.moe_mma {
            MoeProducts::Mma(MoeSplit::new(gpu, maxt, m, hidden)?)
        } else {
            MoeProducts::Cores
        })
    }

    /// `moe_sort`'s work list, where the products take one.
    fn tiles(&self) -> u64 {
        match self {
            MoeProducts::Cores => 0,
            MoeProducts::Mma(sp) => sp.tiles.ptr,
            MoeProducts::Wg { tiles, .. } => tiles.ptr,
        }
    }
}

/// The split activations of the grouped experts' tensor-core products, shared by both: f16
/// `hi` / `lo` and the f32 sums of 32 `asx`, for `maxt` rows of hidden (`moe_split_x`) or
/// `maxt * used` rows of the expert ffn (`moe_split_h`), whichever is larger.
pub struct MoeSplit {
    pub hi: DevBuf,
    pub lo: DevBuf,
    pub asx: DevBuf,
    /// `moe_sort`'s list of the products' tiles (`MoeShape::tiles`).
    pub tiles: DevBuf,
}

impl MoeSplit {
    pub fn new(
        gpu: &Gpu,
        maxt: usize,
        m: MoeShape,
        hidden: usize,
    ) -> Result<MoeSplit, BackendError> {
        let n = (maxt * hidden).max(maxt * m.used * m.ffn);
        Ok(MoeSplit {
            hi: gpu.alloc(n * 2)?,
            lo: gpu.alloc(n * 2)?,
            asx: gpu.alloc(n / 32 * 4)?,
            tiles: gpu.alloc((1 + 2 * m.tiles(maxt)) * 4)?,
        })
    }
}

/// The i32 words of the input buffer for chunks of up to `maxt` tokens and `nout` outputs: tokens,
/// positions and slots per token, the selected rows, and up to one flash tile (two words) per token.
pub fn io_words(maxt: usize, nout: usize) -> usize {
    3 * maxt + nout + 2 * maxt
}

/// How a chunk's attention runs: the split-K kernel (`attention`) with this many splits per KV
/// head, or the flash kernel (`attention_flash`) over this many query tiles, written to
/// [`Bufs::tiles`] with the chunk's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Attn {
    Split(usize),
    Flash(usize),
}

impl CudaBackend {
    /// Whether the O and down products of a chunk on `p` leave the next product's input
    /// (the Hopper path, `GemmPath::hopper`, unless `Tuning::fused_norm` is off), so the QKV product of every
    /// layer after the first and every gate/up product start from it.
    pub(super) fn fused_norm(&self, p: &GemmPath) -> bool {
        // the routed experts' kernels neither take nor leave that input
        self.opts.tuning.fused_norm && p.hopper() && self.gpu.moe.is_none()
    }

    /// The outputs of layer `l`'s QKV product with the queries (or raw rows) to `q`.
    fn qkv_out(&self, l: usize, q: u64) -> QkvOut {
        QkvOut {
            rope: self.w.rope.ptr,
            q,
            kc: self.kv.kc.ptr,
            vc: self.kv.vc.ptr,
            pos: self.b.pos,
            slot: self.b.slot,
            tables: self.kv.tables.ptr,
            layer: l as i32,
            max_blocks: self.kv.max_blocks as i32,
        }
    }

    /// Layer `l`'s Q/K/V biases and Q/K head norm weights on the device (`qkv_rope`'s `bias`
    /// and `qk_norm`), 0 where the family has none.
    fn qkv_extra(&self, l: usize) -> (u64, u64) {
        let w = &self.w.layers[l];
        let ptr = |v: &Option<DevBuf>| v.as_ref().map_or(0, |b| b.ptr);
        (ptr(&w.qkv_bias), ptr(&w.qk_norm))
    }

    /// A layer's QKV product (RMSNorm first unless the product before left its input), on the
    /// GEMM path `pf` or the matrix-vector kernel; `q` takes the queries (rotated; where the family
    /// norms each Q/K head, every raw row: the layout of [`Bufs::qkv`]).
    fn qkv_product(
        &self,
        l: usize,
        pf: Option<&GemmPath>,
        ntok: usize,
        q: u64,
    ) -> Result<(), BackendError> {
        let (g, x) = (&self.gpu, self.b.x.ptr);
        let w = &self.w.layers[l];
        let o = self.qkv_out(l, q);
        match pf {
            // after layer 0 the down product before it left its input (`fused_norm`)
            Some(p) if l > 0 && self.fused_norm(p) => p.qkv(g, &w.wqkv, o, ntok),
            Some(p) => p.norm_qkv(g, x, w.attn_norm.ptr, &w.wqkv, o, ntok),
            None => g.attn_in(o.attn_in(x, w.attn_norm.ptr, &w.wqkv, ntok)),
        }
    }

    /// Layer `l`'s routing of the chunk's `ntok` tokens (`moe_route`: the FFN norm, the router's
    /// logits, each token's experts and weights), the first launch of `Stage::GateUp` on a target
    /// with routed experts.
    pub(super) fn moe_route(&self, l: usize, ntok: usize) -> Result<(), BackendError> {
        let (g, b, w) = (&self.gpu, &self.b, &self.w.layers[l]);
        let m = b.moe.as_ref().ok_or_else(|| {
            BackendError::Model("moe_route on a target without routed experts".into())
        })?;
        let router = w
            .router
            .as_ref()
            .ok_or_else(|| BackendError::Model(format!("layer {l}: no router on the device")))?;
        g.moe_route(abi::MoeRoute {
            x: b.x.ptr,
            norm_w: w.ffn_norm.ptr,
            router: router.ptr,
            xn: m.xn.ptr,
            ids: m.ids.ptr,
            wts: m.wts.ptr,
            counts: m.counts.ptr + (l * g.moe.map_or(0, |x| x.experts) * 4) as u64,
            logits: m.logits.ptr,
            ticket: m.ticket.ptr,
            ntok: ntok as i32,
        })
    }

    /// Layer `l`'s O product and residual add for a one-token chunk with its routing
    /// (`moe_out_route`, [`Gpu::route_fused`]), in place of `attn_out` and `moe_route`.
    pub(super) fn moe_out_route(&self, l: usize) -> Result<(), BackendError> {
        let (g, b, w) = (&self.gpu, &self.b, &self.w.layers[l]);
        let m = b.moe.as_ref().ok_or_else(|| {
            BackendError::Model("moe_out_route on a target without routed experts".into())
        })?;
        let rcols = w.router_cols.as_ref().ok_or_else(|| {
            BackendError::Model(format!("layer {l}: no router columns on the device"))
        })?;
        g.moe_out_route(abi::MoeOutRoute {
            att: b.att.ptr,
            wqs: w.wo.qs.ptr,
            wsc: w.wo.sc_ptr(),
            x: b.x.ptr,
            rcols: rcols.ptr,
            racc: m.route_acc.ptr,
        })
    }

    /// One stage of the forward pass of a chunk over layer `l` (`l` unused by `Embed` and
    /// `LmHead`), on the tensor-core GEMM path when `pf` is given (the four layer products only).
    pub(super) fn launch_stage(
        &self,
        stage: Stage,
        l: usize,
        pf: Option<&GemmPath>,
        (ntok, nout, attn): (usize, usize, Attn),
    ) -> Result<(), BackendError> {
        let g = &self.gpu;
        let b = &self.b;
        let kv = &self.kv;
        let max_blocks = kv.max_blocks as i32;
        let n = ntok as i32;
        let w = || &self.w.layers[l]; // layer stages only
        match (stage, pf) {
            (Stage::Embed, _) => g.embed(abi::Embed {
                qs: self.w.emb.qs.ptr,
                sc: self.w.emb.sc_ptr(),
                tokens: b.tokens,
                x: b.x.ptr,
                ntok: n,
            }),
            (Stage::Qkv, None) if b.qkv.is_some() && g.qkv_head_fused(ntok) => {
                let o = self.qkv_out(l, b.q.ptr);
                g.attn_in_head(o.attn_in_head(
                    b.x.ptr,
                    w().attn_norm.ptr,
                    &w().wqkv,
                    self.qkv_extra(l),
                    g.dims.head_dim,
                ))
            }
            (Stage::Qkv, _) if b.qkv.is_some() => {
                // the product's raw rows, then the biases, the per-head norm, RoPE and the KV write
                let raw = b.qkv.as_ref().map_or(0, |r| r.ptr);
                self.qkv_product(l, pf, ntok, raw)?;
                let o = self.qkv_out(l, b.q.ptr);
                g.qkv_rope(o.qkv_rope(raw, self.qkv_extra(l), g.dims.head_dim, ntok))
            }
            (Stage::Qkv, _) => self.qkv_product(l, pf, ntok, b.q.ptr),
            // where the O product runs on the Hopper GEMMs, the output in their activations' type
            (Stage::Attention, _) => {
                let out16 = pf.map_or(0, |p| p.att_flags());
                match attn {
                    Attn::Flash(ntiles) => g.attention_flash(
                        abi::AttentionFlash {
                            q: b.q.ptr,
                            kc: kv.kc.ptr,
                            vc: kv.vc.ptr,
                            pos: b.pos,
                            slot: b.slot,
                            tables: kv.tables.ptr,
                            layer: l as i32,
                            max_blocks,
                            tiles: b.tiles,
                            flags: out16,
                            out: b.att.ptr,
                        },
                        ntiles,
                    ),
                    Attn::Split(nsplit) => {
                        let flags = g.att_flags | out16 | g.att_pack_flags(ntok, nsplit);
                        let heads_split = g.attention_heads_pay(ntok, nsplit);
                        g.attention(
                            abi::Attention {
                                q: b.q.ptr,
                                kc: kv.kc.ptr,
                                vc: kv.vc.ptr,
                                pos: b.pos,
                                slot: b.slot,
                                tables: kv.tables.ptr,
                                layer: l as i32,
                                max_blocks,
                                nsplit: nsplit as i32,
                                flags,
                                part_ml: b.part_ml.ptr,
                                part_acc: b.part_acc.ptr,
                                counter: b.att_counter.ptr,
                                out: b.att.ptr,
                            },
                            ntok,
                            heads_split,
                        )
                    }
                }
            }
            (Stage::Out, Some(p)) => {
                let next = self.fused_norm(p).then_some(w().ffn_norm.ptr);
                p.out_proj(g, b.att.ptr, &w().wo, b.x.ptr, ntok, next)
            }
            (Stage::Out, None) if g.route_fused(ntok) => self.moe_out_route(l),
            (Stage::Out, None) => g.attn_out(abi::AttnOut {
                att: b.att.ptr,
                wqs: w().wo.qs.ptr,
                wsc: w().wo.sc_ptr(),
                x: b.x.ptr,
                ntok: n,
            }),
            // routed experts (moe.cu.hbs): the matrix-vector kernels a pair; grouped by expert where
            // the chunk has tokens enough, on the tensor cores unless tuned off
            (Stage::GateUp, _) if b.moe.is_some() => {
                let m = b.moe.as_ref().expect("moe buffers");
                let grouped = m
                    .grouped
                    .as_ref()
                    .filter(|_| g.moe.is_some_and(|x| x.grouped(ntok)));
                let fused = g.route_fused(ntok);
                if !fused {
                    self.moe_route(l, ntok)?;
                }
                if let Some(gr) = grouped {
                    g.moe_sort(abi::MoeSort {
                        ids: m.ids.ptr,
                        offsets: gr.offsets.ptr,
                        order: gr.order.ptr,
                        tiles: gr.products.tiles(),
                        ntok: n,
                    })?;
                    if let MoeProducts::Wg { a, tiles } = &gr.products {
                        g.wg_act_head(abi::WgActHead {
                            x: b.x.ptr,
                            sel: 0,
                            norm_w: w().ffn_norm.ptr,
                            a: a.ptr,
                            ntok: n,
                        })?;
                        let gu = abi::MoeGuWg {
                            a: a.ptr,
                            w: w().wgu.qs.ptr,
                            wsc: w().wgu.sc_ptr(),
                            offsets: gr.offsets.ptr,
                            order: gr.order.ptr,
                            tiles: tiles.ptr,
                            h: m.h.ptr,
                            ntok: n,
                        };
                        return g.moe_gu_wg(gu, g.wq_gemm);
                    }
                    if let MoeProducts::Mma(sp) = &gr.products {
                        g.moe_split_x(abi::MoeSplitX {
                            x: m.xn.ptr,
                            hi: sp.hi.ptr,
                            lo: sp.lo.ptr,
                            asx: sp.asx.ptr,
                            ntok: n,
                        })?;
                        return g.moe_gu_mma(abi::MoeGuMma {
                            ahi: sp.hi.ptr,
                            alo: sp.lo.ptr,
                            asx: sp.asx.ptr,
                            wqs: w().wgu.qs.ptr,
                            wsc: w().wgu.sc_ptr(),
                            offsets: gr.offsets.ptr,
                            order: gr.order.ptr,
                            tiles: sp.tiles.ptr,
                            h: m.h.ptr,
                            ntok: n,
                        });
                    }
                    return g.moe_gu_grouped(abi::MoeGuGrouped {
                        xn: m.xn.ptr,
                        wqs: w().wgu.qs.ptr,
                        wsc: w().wgu.sc_ptr(),
                        offsets: gr.offsets.ptr,
                        order: gr.order.ptr,
                        h: m.h.ptr,
                        ntok: n,
                    });
                }
                // after moe_out_route, the residual, normed here
                let (xn, racc) = match fused {
                    true => (b.x.ptr, m.route_acc.ptr),
                    false => (m.xn.ptr, 0),
                };
                g.moe_gu(abi::MoeGu {
                    xn,
                    wqs: w().wgu.qs.ptr,
                    wsc: w().wgu.sc_ptr(),
                    ids: m.ids.ptr,
                    norm_w: w().ffn_norm.ptr,
                    racc,
                    wts: m.wts.ptr,
                    counts: m.counts.ptr + (l * g.moe.map_or(0, |x| x.experts) * 4) as u64,
                    h: m.h.ptr,
                    ntok: n,
                })
            }
            (Stage::Down, _) if b.moe.is_some() => {
                let m = b.moe.as_ref().expect("moe buffers");
                let grouped = m
                    .grouped
                    .as_ref()
                    .filter(|_| g.moe.is_some_and(|x| x.grouped(ntok)));
                if let Some(gr) = grouped {
                    match &gr.products {
                        MoeProducts::Wg { tiles, .. } => {
                            let dn = abi::MoeDownWg {
                                a: m.h.ptr,
                                w: w().wdown.qs.ptr,
                                wsc: w().wdown.sc_ptr(),
                                offsets: gr.offsets.ptr,
                                order: gr.order.ptr,
                                tiles: tiles.ptr,
                                y: gr.y.ptr,
                                ntok: n,
                            };
                            g.moe_down_wg(dn, g.wq_gemm)?
                        }
                        MoeProducts::Mma(sp) => {
                            g.moe_split_h(abi::MoeSplitH {
                                x: m.h.ptr,
                                hi: sp.hi.ptr,
                                lo: sp.lo.ptr,
                                asx: sp.asx.ptr,
                                ntok: n,
                            })?;
                            g.moe_down_mma(abi::MoeDownMma {
                                ahi: sp.hi.ptr,
                                alo: sp.lo.ptr,
                                asx: sp.asx.ptr,
                                wqs: w().wdown.qs.ptr,
                                wsc: w().wdown.sc_ptr(),
                                offsets: gr.offsets.ptr,
                                order: gr.order.ptr,
                                tiles: sp.tiles.ptr,
                                y: gr.y.ptr,
                                ntok: n,
                            })?
                        }
                        MoeProducts::Cores => g.moe_down_grouped(abi::MoeDownGrouped {
                            h: m.h.ptr,
                            wqs: w().wdown.qs.ptr,
                            wsc: w().wdown.sc_ptr(),
                            offsets: gr.offsets.ptr,
                            order: gr.order.ptr,
                            y: gr.y.ptr,
                            ntok: n,
                        })?,
                    }
                    return g.moe_combine(abi::MoeCombine {
                        y: gr.y.ptr,
                        wts: m.wts.ptr,
                        x: b.x.ptr,
                        ntok: n,
                    });
                }
                g.moe_down(abi::MoeDown {
                    h: m.h.ptr,
                    wqs: w().wdown.qs.ptr,
                    wsc: w().wdown.sc_ptr(),
                    ids: m.ids.ptr,
                    wts: m.wts.ptr,
                    x: b.x.ptr,
                    // after moe_out_route: its sums zeroed
                    racc: match g.route_fused(ntok) {
                        true => m.route_acc.ptr,
                        false => 0,
                    },
                    ntok: n,
                })
            }
            (Stage::GateUp, Some(p)) if self.fused_norm(p) => p.gate_up(g, &w().wgu, b.h.ptr, ntok),
            (Stage::GateUp, Some(p)) => {
                p.norm_gate_up(g, b.x.ptr, w().ffn_norm.ptr, &w().wgu, b.h.ptr, ntok)
            }
            (Stage::GateUp, None) => g.ffn_in(abi::FfnIn {
                x: b.x.ptr,
                norm_w: w().ffn_norm.ptr,
                wqs: w().wgu.qs.ptr,
                wsc: w().wgu.sc_ptr(),
                h: b.h.ptr,
                ntok: n,
            }),
            (Stage::Down, Some(p)) => {
                let next = self.w.layers.get(l + 1).map(|n| n.attn_norm.ptr);
                let next = next.filter(|_| self.fused_norm(p));
                p.down(g, b.h.ptr, &w().wdown, b.x.ptr, ntok, next)
            }
            (Stage::Down, None) => g.ffn_out(abi::FfnOut {
                h: b.h.ptr,
                wqs: w().wdown.qs.ptr,
                wsc: w().wdown.sc_ptr(),
                x: b.x.ptr,
                ntok: n,
            }),
            (Stage::LmHead, _) if self.gemm.head_pays(&g.dims, nout) => {
                self.gemm.logits(
                    g,
                    b.x.ptr,
                    b.sel,
                    self.w.out_norm.ptr,
                    self.w.head(),
                    b.logits.ptr,
                    nout,
                )?;
                g.argmax(abi::ArgmaxLogprob {
                    logits: b.logits.ptr,
                    part: b.lm_part.ptr,
                    counter: b.lm_counter.ptr,
                    out_tok: b.out_tok,
                    out_logprob: b.out_lp,
                    ntok: nout as i32,
                })
            }
            (Stage::LmHead, _) => {
                let head = self.w.head();
                g.lm_head(abi::LmHead {
                    x: b.x.ptr,
                    sel: b.sel,
                    norm_w: self.w.out_norm.ptr,
                    wqs: head.qs.ptr,
                    wsc: head.sc_ptr(),
                    logits: b.logits.ptr,
                    ntok: nout as i32,
                    part: b.lm_part.ptr,
                    counter: b.lm_counter.ptr,
                    out_tok: b.out_tok,
                    out_logprob: b.out_lp,
                })
            }
        }
    }

    /// Enqueue the whole forward pass of one chunk (inputs already in the token/pos/slot/sel
    /// buffers). `gemm`: run the layer products as tensor-core GEMMs instead of matvecs.
    pub(super) fn enqueue(
        &self,
        ntok: usize,
        nout: usize,
        attn: Attn,
        gemm: bool,
    ) -> Result<(), BackendError> {
        let pf = gemm.then_some(&self.gemm);
        let shape = (ntok, nout, attn);
        self.launch_stage(Stage::Embed, 0, None, shape)?;
        for l in 0..self.w.layers.len() {
            for stage in Stage::LAYER {
                self.launch_stage(stage, l, pf, shape)?;
            }
        }
        if nout > 0 {
            self.launch_stage(Stage::LmHead, 0, None, shape)?;
        }
        Ok(())
    }
}

/// The words of the grammar masks' buffer for `nout` outputs: a row index per output, then a mask
/// row per output.
pub fn mask_words(nout: usize, vocab: usize) -> usize {
    nout * (1 + vocab.div_ceil(32))
}
