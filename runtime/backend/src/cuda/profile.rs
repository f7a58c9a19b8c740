//! Bench-only measurements of the CUDA backend (`examples/cuda_bench.rs`): each kernel of the last
//! chunk timed alone, the last decode step replayed back to back, and `decode_1`'s per-stage trace.
//! They rewrite the activations and the KV entries of the last chunk: never call them while serving.

use metrale_core::BackendError;

use super::forward::Stage;
use super::launch::Occupancy;
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

impl CudaBackend {
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
    /// K and V rows of each KV head).
    pub fn kv_bytes_read(&self, positions: usize) -> u64 {
        let d = &self.gpu.dims;
        (positions * 2 * d.layers * d.kd() * self.kv.dtype.bytes()) as u64
    }

    /// Time each kernel alone at the shape of the last chunk (layer 0's weights): a graph of `reps`
    /// launches of one kernel, replayed `rounds` times; microseconds per launch, graph-node overhead
    /// included.
    pub fn profile_kernels(
        &mut self,
        reps: usize,
        rounds: usize,
    ) -> Result<Vec<(&'static str, f64)>, BackendError> {
        let Some((ntok, nsplit)) = self.last_key else {
            return Ok(Vec::new());
        };
        let nout = ntok.min(self.opts.slots);
        let mut out = Vec::new();
        let stages = [
            ("embed", Stage::Embed, false),
            ("attn_in", Stage::Qkv, false),
            ("attention", Stage::Attention, false),
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
            g.begin_capture()?;
            let mut r = Ok(());
            for _ in 0..reps {
                r = r.and_then(|_| self.launch_stage(stage, 0, pf, (ntok, nout, nsplit)));
            }
            let graph = g.end_capture();
            r?;
            let graph = graph?;
            g.replay(&graph)?;
            g.sync()?;
            let t = std::time::Instant::now();
            for _ in 0..rounds {
                g.replay(&graph)?;
            }
            g.sync()?;
            out.push((
                name,
                t.elapsed().as_secs_f64() * 1e6 / (reps * rounds) as f64,
            ));
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
    pub fn decode1_info(&self) -> Option<Decode1Info> {
        self.decode1.as_ref().map(|k| Decode1Info {
            blocks: k.blocks,
            smem_bytes: k.smem_bytes,
            occupancy: k.occupancy,
            split: k.split,
        })
    }
}
