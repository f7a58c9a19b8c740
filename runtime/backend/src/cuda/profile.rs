//! Bench-only measurements of the CUDA backend (`examples/cuda_bench.rs`): each kernel of the last
//! chunk timed alone, the last decode step replayed back to back, and `decode_1`'s per-stage trace.
//! They rewrite the activations and the KV entries of the last chunk: never call them while serving.

use metrale_abi as abi;
use metrale_core::BackendError;

use super::forward::{Attn, Stage};
use super::gemm::{Product, QkvOut};
use super::launch::Occupancy;
use super::plan::{self, TmaPlan};
use super::CudaBackend;

/// What `decode_1` runs as on this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decode1Info {
    pub blocks: u32,
    pub smem_bytes: u32,
    pub occupancy: Occupancy,
    /// (positions per split, most splits per KV head)
    pub split: (usize, usize),
}

/// A graph of `reps` calls of `launch` (each enqueues kernels), replayed once to warm it up.
fn capture_warm(
    g: &super::launch::Gpu,
    reps: usize,
    launch: impl Fn() -> Result<(), BackendError>,
) -> Result<cudarc::driver::CudaGraph, BackendError> {
    g.begin_capture()?;
    let mut r = Ok(());
    for _ in 0..reps {
        r = r.and_then(|_| launch());
    }
    let graph = g.end_capture();
    r?;
    let graph = graph?;
    g.replay(&graph)?;
    g.sync()?;
    Ok(graph)
}

/// Microseconds per call of `launch`: a [`capture_warm`] graph of `reps` calls replayed `rounds`
/// times back to back, the host clock around all of them and one wait.
fn replay_mean_us(
    g: &super::launch::Gpu,
    reps: usize,
    rounds: usize,
    launch: impl Fn() -> Result<(), BackendError>,
) -> Result<f64, BackendError> {
    let graph = capture_warm(g, reps, launch)?;
    let t = std::time::Instant::now();
    for _ in 0..rounds {
        g.replay(&graph)?;
    }
    g.sync()?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / (reps * rounds) as f64)
}

/// Microseconds per call of `launch`: a [`capture_warm`] graph of `reps` calls replayed 7 times,
/// each timed by the host clock around the replay and a wait; the median.
fn replay_median_us(
    g: &super::launch::Gpu,
    reps: usize,
    launch: impl Fn() -> Result<(), BackendError>,
) -> Result<f64, BackendError> {
    let graph = capture_warm(g, reps, launch)?;
    let mut v = Vec::new();
    for _ in 0..7 {
        let t0 = std::time::Instant::now();
        g.replay(&graph)?;
        g.sync()?;
        v.push(t0.elapsed().as_secs_f64() * 1e6 / reps as f64);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

/// One Hopper GEMM timed alone ([`CudaBackend::profile_gemms`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmTiming {
    /// `qkv`, `o`, `gate_up`, `down`, `lm_head`
    pub product: &'static str,
    pub rows: usize,
    pub k: usize,
    pub ntok: usize,
    /// Bytes of the weight matrix as stored on the device (bf16: 2 per weight; q4_1: 0.625; q8_0:
    /// 1.0625): the memory floor's numerator.
    pub weight_bytes: usize,
    /// `with_act` (the bf16 conversion and the product as the forward pass runs them), `wgmma`
    /// (`gemm_hopper.cu.hbs`), `tma` (`gemm_tma.cu.hbs` at `cfg` x `splits`)
    pub kernel: &'static str,
    /// The warp-specialised launch (`tma`, and `with_act` where the plan takes it).
    pub tma: Option<TmaPlan>,
    /// The launch the backend would choose for this product and chunk.
    pub planned: bool,
    /// The warp-specialised launch `plan::tma_plan`'s estimate picks (what the backend runs from
    /// `gemm::TMA_MIN_TOKENS` tokens).
    pub estimate_pick: bool,
    /// Microseconds per launch: the median of the rounds.
    pub us: f64,
}

impl CudaBackend {
    /// Time each Hopper GEMM of layer 0 and the LM head over `ntok` tokens alone: the conversion
    /// and product as the forward pass runs them, `gemm_hopper.cu.hbs`'s kernel, the planned
    /// warp-specialised launch and, with `sweep`, every other tile and K split `plan::tma_plan`
    /// could pick. Each is a graph of enough launches for ~2 ms, replayed 7 times, timed by the host
    /// clock around each replay and a wait; microseconds per launch, the median. The inputs are
    /// the activation buffers as the last chunk left them (a chunk of `ntok` tokens should have run:
    /// real values, not zeros); positions `t % 1024` of slot 0 take the K/V writes. Rewrites the
    /// activations, slot 0's KV entries and the first `ntok` positions' inputs: bench only.
    pub fn profile_gemms(
        &mut self,
        ntok: usize,
        sweep: bool,
    ) -> Result<Vec<GemmTiming>, BackendError> {
        if !self.gemm.hopper() || ntok == 0 || ntok > self.opts.max_step_tokens {
            return Ok(Vec::new());
        }
        let d = self.gpu.dims;
        let t = self.opts.max_step_tokens;
        let pos: Vec<i32> = (0..ntok).map(|i| (i % 1024) as i32).collect();
        self.gpu.write(&self.b.io_in, t * 4, &pos)?;
        self.gpu
            .write(&self.b.io_in, 2 * t * 4, &vec![0i32; ntok])?;
        // the LM head over every row: its own logits and row selection (the chunk's `sel` holds
        // one row per slot)
        let logits = self.gpu.alloc(ntok * d.vocab * 4)?;
        let sel = self.gpu.upload(&(0..ntok as i32).collect::<Vec<i32>>())?;
        let l0 = &self.w.layers[0];
        let b = &self.b;
        let qkv = Product::Qkv(QkvOut {
            rope: self.w.rope.ptr,
            q: b.q.ptr,
            kc: self.kv.kc.ptr,
            vc: self.kv.vc.ptr,
            pos: b.pos,
            slot: b.slot,
            tables: self.kv.tables.ptr,
            layer: 0,
            max_blocks: self.kv.max_blocks as i32,
        });
        let head_ok = self.gemm.head_pays(&d, ntok.max(3));
        // the O and down products leave the next one's input where the forward pass has them do so
        let fused = self.fused_norm(&self.gemm);
        let next_attn = self.w.layers.get(1).unwrap_or(l0).attn_norm.ptr;
        let mut products = vec![
            (qkv, &l0.wqkv),
            (
                Product::Out {
                    att: b.att.ptr,
                    x: b.x.ptr,
                    next: fused.then_some(l0.ffn_norm.ptr),
                },
                &l0.wo,
            ),
        ];
        // routed experts run on their own kernels, not these products
        if self.gpu.moe.is_none() {
            products.push((Product::GateUp { h: b.h.ptr }, &l0.wgu));
            let next = fused.then_some(next_attn);
            let down = Product::Down {
                h: b.h.ptr,
                x: b.x.ptr,
                next,
            };
            products.push((down, &l0.wdown));
        }
        if head_ok {
            products.push((Product::Head { logits: logits.ptr }, self.w.head()));
        }
        let g = &self.gpu;
        let gp = &self.gemm;
        let mut out = Vec::new();
        for (p, w) in products {
            let (rows, k, weight_bytes) = (w.rows, w.k, w.bytes());
            // the conversion and product as the forward pass runs them (this also leaves the
            // product's bf16 activations in the scratch for the launches below; with the fused
            // norm, layer 0's QKV converts, the gate/up product reads what the O product left)
            let act = |g: &super::launch::Gpu| -> Result<(), BackendError> {
                match p {
                    Product::Qkv(o) => gp.norm_qkv(g, b.x.ptr, l0.attn_norm.ptr, w, o, ntok),
                    Product::Out { att, x, next } => gp.out_proj(g, att, w, x, ntok, next),
                    Product::GateUp { h } if fused => gp.gate_up(g, w, h, ntok),
                    Product::GateUp { h } => {
                        gp.norm_gate_up(g, b.x.ptr, l0.ffn_norm.ptr, w, h, ntok)
                    }
                    Product::Down { h, x, next } => gp.down(g, h, w, x, ntok, next),
                    Product::Head { logits } => {
                        gp.logits(g, b.x.ptr, sel.ptr, self.w.out_norm.ptr, w, logits, ntok)
                    }
                }
            };
            let planned = gp.tma_plan(g.sm_count, &p, w, ntok);
            let pick = plan::tma_plan(rows, k, ntok, g.sm_count, p.residual(), g.tma_96);
            let est = plan::tma_estimate(rows, k, ntok, 0, 1, g.sm_count) * 1e6;
            let reps = ((2000.0 / est.max(1.0)) as usize).clamp(3, 100);
            let time = |launch: &dyn Fn(&super::launch::Gpu) -> Result<(), BackendError>| {
                replay_median_us(g, reps, || launch(g))
            };
            let mut row = |kernel, tma: Option<TmaPlan>, planned: bool, us: f64| {
                out.push(GemmTiming {
                    product: p.name(),
                    rows,
                    k,
                    ntok,
                    weight_bytes,
                    kernel,
                    tma,
                    planned,
                    estimate_pick: kernel == "tma" && tma == pick,
                    us,
                })
            };
            // the activations of this product's K in the scratch first
            act(g)?;
            g.sync()?;
            row("with_act", planned, true, time(&act)?);
            let wg = time(&|g| gp.wgmma_product(g, p, w, ntok))?;
            row("wgmma", None, planned.is_none(), wg);
            if !g.tma_gemm {
                continue;
            }
            let mut launches: Vec<TmaPlan> = pick.into_iter().collect();
            if sweep {
                for cfg in 0..metrale_abi::layout::TMA_CONFIGS.len() {
                    for splits in [1, 2, 3, 4, 6, 8] {
                        if let Some(l) =
                            plan::tma_launch(rows, k, ntok, cfg, splits, g.sm_count, p.residual())
                        {
                            if !launches.contains(&l) {
                                launches.push(l);
                            }
                        }
                    }
                }
            }
            for l in launches {
                let us = time(&|g| gp.tma_product(g, p, w, ntok, l))?;
                row("tma", Some(l), Some(l) == planned, us);
            }
        }
        Ok(out)
    }

    /// The greedy arg-max of `nout` logits rows alone (`argmax_logprob` over a buffer of random
    /// logits), as [`Self::profile_gemms`] times a product: microseconds per launch with each row
    /// over `plan::argmax_splits` blocks, then with one block a row, the read floor (the rows'
    /// bytes at `copy_gbs`) and the blocks a row. Bench only.
    pub fn profile_argmax(
        &self,
        nout: usize,
        copy_gbs: f64,
    ) -> Result<(f64, f64, f64, u32), BackendError> {
        let g = &self.gpu;
        let v = g.dims.vocab;
        let vals: Vec<f32> = (0..nout * v)
            .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / 1e6 - 8.0)
            .collect();
        let logits = g.upload(&vals)?;
        let (pb, cb) = g.argmax_scratch(nout);
        let (part, counter, out) = (g.alloc(pb)?, g.alloc(cb)?, g.alloc(8 * nout)?);
        let a = abi::ArgmaxLogprob {
            logits: logits.ptr,
            part: part.ptr,
            counter: counter.ptr,
            out_tok: out.ptr,
            out_logprob: out.ptr + (4 * nout) as u64,
            ntok: nout as i32,
        };
        let time = |split: bool| replay_median_us(g, 20, || g.argmax_with(a, split));
        let floor = (nout * v * 4) as f64 / (copy_gbs * 1e3);
        let splits = plan::argmax_splits(nout, v, g.sm_count);
        Ok((time(true)?, time(false)?, floor, splits))
    }

    /// Device-to-device copy rate in GB/s (bytes read plus bytes written, per second) of a copy of
    /// `bytes`: median of 7 samples of 5 back-to-back copies, after one warm-up copy. The
    /// bandwidth floor the decode figures are compared with. Allocates two `bytes` buffers for the
    /// measurement only.
    pub fn copy_rate_gbs(&self, bytes: usize) -> Result<f64, BackendError> {
        let g = &self.gpu;
        let (a, b) = (g.alloc(bytes)?, g.alloc(bytes)?);
        g.copy_async(&b, &a)?;
        g.sync()?;
        let mut rates = Vec::new();
        for _ in 0..7 {
            let t = std::time::Instant::now();
            for _ in 0..5 {
                g.copy_async(&b, &a)?;
            }
            g.sync()?;
            rates.push(2.0 * 5.0 * bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        rates.sort_by(f64::total_cmp);
        Ok(rates[rates.len() / 2])
    }

    /// Weight bytes one single-sequence decode step reads (the embedding table's one row, when the
    /// LM head is a separate matrix).
    pub fn decode_weight_bytes(&self) -> u64 {
        self.w.decode_bytes()
    }

    /// KV bytes one single-sequence decode step reads at `positions` cached positions (every layer's
    /// K and V rows of each KV head, an fp8 cache's scales included).
    pub fn kv_bytes_read(&self, positions: usize) -> u64 {
        let d = &self.gpu.dims;
        (positions * 2 * d.layers * d.kv_heads * self.kv.dtype.vector_bytes(d.head_dim)) as u64
    }

    /// Time each kernel alone at the shape of the last chunk (layer 0's weights): a graph of `reps`
    /// launches of one kernel, replayed `rounds` times; microseconds per launch, graph-node overhead
    /// included. On a target with routed experts, `moe_route` is also timed alone (it is part of
    /// `ffn_in`'s time, the routing and the experts' gate/up) unless the chunk routes inside its O
    /// product (`attn_out`'s time then: `moe_out_route`).
    pub fn profile_kernels(
        &mut self,
        reps: usize,
        rounds: usize,
    ) -> Result<Vec<(&'static str, f64)>, BackendError> {
        self.profile_stages(reps, rounds, false)
    }

    /// [`CudaBackend::profile_kernels`] with each launch of a layer's kernel on the next layer's
    /// weights and KV entries (a graph of one launch a layer, replayed `rounds` times): what the
    /// stage costs where its weights come from memory, not from the L2 the repeats of one layer's
    /// launch leave them in, and with the hand-over between launches of one kernel. Beside a step's
    /// graph replay, the difference is what the hand-overs between different kernels cost.
    pub fn profile_kernels_across_layers(
        &mut self,
        rounds: usize,
    ) -> Result<Vec<(&'static str, f64)>, BackendError> {
        let layers = self.w.layers.len();
        self.profile_stages(layers, rounds, true)
    }

    fn profile_stages(
        &mut self,
        reps: usize,
        rounds: usize,
        across_layers: bool,
    ) -> Result<Vec<(&'static str, f64)>, BackendError> {
        let Some((ntok, _, attn)) = self.last_key else {
            return Ok(Vec::new());
        };
        let nout = ntok.min(self.opts.outputs());
        let mut out = Vec::new();
        let stages = [
            ("embed", Stage::Embed, false),
            ("attn_in", Stage::Qkv, false),
            (
                match attn {
                    Attn::Flash(_) => "attention_flash",
                    Attn::Split(_) => "attention",
                },
                Stage::Attention,
                false,
            ),
            ("attn_out", Stage::Out, false),
            ("ffn_in", Stage::GateUp, false),
            ("ffn_out", Stage::Down, false),
            ("lm_head", Stage::LmHead, false),
            ("gemm_norm_qkv", Stage::Qkv, true),
            ("gemm_o", Stage::Out, true),
            ("gemm_norm_gu", Stage::GateUp, true),
            ("gemm_down", Stage::Down, true),
        ];
        for (name, stage, gemm) in stages {
            let g = &self.gpu;
            let pf = gemm.then_some(&self.gemm);
            // the O product reads the attention's output in the GEMM path's type
            // (`GemmPath::act_type`): the attention once more as that path runs it
            if let (Stage::Out, Some(_)) = (stage, pf) {
                self.launch_stage(Stage::Attention, 0, pf, (ntok, nout, attn))?;
            }
            let layers = self.w.layers.len();
            let next = std::cell::Cell::new(0usize);
            let us = replay_mean_us(g, reps, rounds, || {
                let l = match across_layers {
                    true => next.replace(next.get() + 1) % layers,
                    false => 0,
                };
                self.launch_stage(stage, l, pf, (ntok, nout, attn))
            })?;
            out.push((name, us));
        }
        // timed alone where it runs (not inside moe_out_route)
        if self.b.moe.is_some() && !self.gpu.route_fused(ntok) {
            let us = replay_mean_us(&self.gpu, reps, rounds, || self.moe_route(0, ntok))?;
            out.push(("moe_route", us));
        }
        Ok(out)
    }

    /// Replay the last decode step `n` times back to back and return the device time per replay in
    /// microseconds (host clock around `n` launches and one wait): the GPU-side cost of a decode
    /// step without the host's input and output copies. Replays rewrite the same KV entries.
    pub fn time_graph_replay(&mut self, n: usize) -> Result<Option<f64>, BackendError> {
        if let Some(s) = self.last_decode1 {
            // the persistent kernel: the same step relaunched n times
            self.gpu.sync()?;
            let t = std::time::Instant::now();
            for _ in 0..n {
                self.launch_decode1(s)?;
            }
            self.gpu.sync()?;
            return Ok(Some(t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64));
        }
        let Some(key) = self.last_key else {
            return Ok(None);
        };
        let Some(g) = self.graphs.get(&key) else {
            return Ok(None);
        };
        self.gpu.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..n {
            self.gpu.replay(g)?;
        }
        self.gpu.sync()?;
        Ok(Some(t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64))
    }

    /// What a grammar-masked greedy pick adds to a `decode_1` step on the device: the last step
    /// relaunched `n` times back to back (host clock around the launches and one wait; the host
    /// enqueues far faster than a step runs), microseconds per step with after each launch (0)
    /// nothing, (1) the mask's staging, (2) that and `mask_logits` (how several rows are masked),
    /// (3) the one-row masked pick (the staging and `argmax_masked_1`). `None` when the last step
    /// was not a `decode_1` step.
    pub fn time_masked_pick(&mut self, n: usize) -> Result<Option<[f64; 4]>, BackendError> {
        let Some(s) = self.last_decode1 else {
            return Ok(None);
        };
        // every other token id allowed
        let mask = vec![0x5555_5555u32; self.gpu.dims.vocab.div_ceil(32)];
        let mut out = [0f64; 4];
        for (k, us) in out.iter_mut().enumerate() {
            self.gpu.sync()?;
            let t = std::time::Instant::now();
            for _ in 0..n {
                self.launch_decode1(s)?;
                match k {
                    0 => {}
                    1 => {
                        self.stage_masks(1, |_| Some(&mask[..]))?;
                    }
                    2 => self.mask_rows(1, |_| Some(&mask[..]))?,
                    _ => self.masked_pick(&mask, (self.b.out_tok, self.b.out_lp))?,
                }
            }
            self.gpu.sync()?;
            *us = t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64;
        }
        Ok(Some(out))
    }

    /// Relaunch the last `decode_1` step with its trace on and return (blocks, the trace:
    /// `metrale_abi::layout::decode_trace_words` globaltimer stamps). `None` when the last step
    /// was not a `decode_1` step.
    pub fn trace_decode1(&mut self) -> Result<Option<(u32, Vec<u64>)>, BackendError> {
        let (Some(s), Some(k)) = (self.last_decode1, self.decode1.as_mut()) else {
            return Ok(None);
        };
        for _ in 0..3 {
            k.launch(&self.gpu, s, true)?;
        }
        self.gpu.sync()?;
        Ok(Some((k.blocks, k.read_trace(&self.gpu)?)))
    }

    /// The persistent decode kernel, when loaded: its grid, shared memory, occupancy and split.
    /// The routed experts' histogram since start or the last [`CudaBackend::clear_expert_counts`]:
    /// per layer, how often each expert was chosen (`None`: the family has no routed experts).
    /// Synchronises the stream.
    pub fn expert_counts(&self) -> Result<Option<Vec<Vec<u32>>>, BackendError> {
        let (Some(m), Some(x)) = (self.b.moe.as_ref(), self.gpu.moe) else {
            return Ok(None);
        };
        let mut all = vec![0u32; self.w.layers.len() * x.experts];
        self.gpu.sync()?;
        self.gpu.read(&m.counts, 0, &mut all)?;
        Ok(Some(all.chunks(x.experts).map(<[u32]>::to_vec).collect()))
    }

    /// Zero the routed experts' histogram.
    pub fn clear_expert_counts(&self) -> Result<(), BackendError> {
        match self.b.moe.as_ref() {
            Some(m) => self.gpu.zero_async(&m.counts),
            None => Ok(()),
        }
    }

    pub fn decode1_info(&self) -> Option<Decode1Info> {
        self.decode1.as_ref().map(|k| Decode1Info {
            blocks: k.blocks,
            smem_bytes: k.smem_bytes,
            occupancy: k.occupancy,
            split: k.split,
        })
    }
}
