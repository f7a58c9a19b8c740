//! The sharded weight loader of tensor parallelism (`metrale_model::shard`), checked on the host:
//! for test models of each family (synth-model's, seed 0) split over 2 and 4 ranks, every layer's
//! products computed by the CPU backend's ops from each rank's tensors and put together as
//! Megatron's split puts them (column-parallel outputs concatenated, row-parallel outputs summed:
//! what the all-reduce after O and after down computes) equal the unsplit model's:
//! - Q, K, V (and their biases) of a rank are the unsplit rows of its heads, bit for bit; with
//!   fewer KV heads than ranks, each rank holds the KV head its query heads read;
//! - the sum over ranks of O (of each rank's heads' columns) and of the MLP's down (of each
//!   rank's FFN slice through gate, up and SiLU) is the unsplit matrix's product (computed in f64
//!   from its rows) within f32 summation order: 1e-5 of the sum of the terms' magnitudes. For FP8
//!   each rank quantizes the slice of the input it holds, its own per-token scale (as vLLM's
//!   tensor-parallel FP8 does; the unsplit model's one scale a token would need an all-reduce of
//!   the row's largest magnitude first), and the reference does the same;
//! - routed experts split each expert's FFN the same way; the router stays whole;
//! - Q4_1 blocks and FP8 row scales split with their rows, and a split that would cut a block is
//!   refused by name.
//!
//! Needs METRALE_MODEL (the default model: the tokenizer of the synthetic ones).

mod toolchain_support;

use metrale_backend::cpu::mat::{Fp8Ref, MatRef};
use metrale_backend::cpu::ops;
use metrale_model::shard::{shard, Plan};
use metrale_model::{Model, ModelConfig, Weights};
use toolchain_support::*;

fn synth(dir: &std::path::Path, toml: &str, extra: &[&str]) -> Option<Model> {
    let out = dir.join(format!("{toml}{}.gguf", extra.join("")));
    synth_golden_model(toml, &out, extra).then(|| Model::load(&out).unwrap())
}

/// `w`'s matrix `name` (expert `e` of it where given) as the CPU ops read it, FP8 scales included.
fn mat<'a>(
    w: &'a Weights,
    c: &ModelConfig,
    name: &str,
    e: Option<usize>,
    scales: &'a mut Vec<f32>,
) -> MatRef<'a> {
    let t = match e {
        Some(e) => w.expert(name, e).unwrap(),
        None => w.get(name).unwrap(),
    };
    let fp8 = (t.dtype == metrale_core::dtype::DType::F8_E4M3).then(|| {
        *scales = metrale_model::fp8::scales(w, c, t.name).unwrap().0;
        Fp8Ref {
            scales: scales.as_slice(),
            input_scale: None,
            ub: None,
        }
    });
    MatRef {
        dtype: t.dtype,
        rows: t.n_rows(),
        cols: t.row_len(),
        data: t.data,
        packed: false,
        fp8,
    }
}

/// `n` tokens' product with matrix `name` of `w`: `[n][rows]`.
fn prod(
    w: &Weights,
    c: &ModelConfig,
    name: &str,
    e: Option<usize>,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let mut s = Vec::new();
    let m = mat(w, c, name, e, &mut s);
    let mut out = vec![0f32; n * m.rows];
    ops::matmul(m, x, n, &mut out);
    out
}

/// Matrix `m`'s rows widened to f32 (`[rows][cols]`) and each row's scale (FP8's, else 1).
fn widened(m: &MatRef<'_>) -> (Vec<f32>, Vec<f32>) {
    let rb = m.row_bytes();
    let mut rows = vec![0f32; m.rows * m.cols];
    for (r, row) in rows.chunks_exact_mut(m.cols).enumerate() {
        metrale_core::dtype::dequantize_row(m.dtype, &m.data[r * rb..(r + 1) * rb], row).unwrap();
    }
    let scales = (0..m.rows)
        .map(|r| m.fp8.map_or(1.0, |f| f.scales[r]))
        .collect();
    (rows, scales)
}

/// sum_k |w[r][k]| |x[t][k]| for every output: bounds the rounding of any order of the sum.
fn abs_bound(
    w: &Weights,
    c: &ModelConfig,
    name: &str,
    e: Option<usize>,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let mut s = Vec::new();
    let m = mat(w, c, name, e, &mut s);
    let (rows, scales) = widened(&m);
    let mut out = vec![0f32; n * m.rows];
    for (r, row) in rows.chunks_exact(m.cols).enumerate() {
        let sc = scales[r].abs();
        for t in 0..n {
            out[t * m.rows + r] = row
                .iter()
                .zip(&x[t * m.cols..(t + 1) * m.cols])
                .map(|(w, v)| (w * sc * v).abs())
                .sum();
        }
    }
    out
}

/// What the ranks of a row-parallel product compute together, from the unsplit matrix: for each
/// rank's columns `ranges[r]`, that slice of every row times the rank's slice of `x` (quantized per
/// token on its own where the matrix is FP8: each rank quantizes the input it holds, as vLLM's
/// tensor-parallel FP8 does), summed over ranks in f64.
fn row_parallel(
    w: &Weights,
    c: &ModelConfig,
    name: &str,
    e: Option<usize>,
    x: &[f32],
    n: usize,
    ranges: &[std::ops::Range<usize>],
) -> Vec<f32> {
    let mut s = Vec::new();
    let m = mat(w, c, name, e, &mut s);
    let (rows, scales) = widened(&m);
    let mut out = vec![0f64; n * m.rows];
    for rg in ranges {
        let mut xr = cols(x, m.cols, rg.clone());
        if m.fp8.is_some() {
            metrale_core::fp8::quantize_activations(&mut xr, rg.len(), None, None);
        }
        for (r, row) in rows.chunks_exact(m.cols).enumerate() {
            let sc = scales[r] as f64;
            for t in 0..n {
                out[t * m.rows + r] += row[rg.clone()]
                    .iter()
                    .zip(&xr[t * rg.len()..(t + 1) * rg.len()])
                    .map(|(w, v)| *w as f64 * *v as f64)
                    .sum::<f64>()
                    * sc;
            }
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    metrale_backend::cpu::synthetic::rand_vec(n, seed)
}

/// Columns `c` of each of the `n` rows of `x` (row length `len`).
fn cols(x: &[f32], len: usize, c: std::ops::Range<usize>) -> Vec<f32> {
    x.chunks(len).flat_map(|r| r[c.clone()].to_vec()).collect()
}

fn close_sum(what: &str, parts: &[Vec<f32>], want: &[f32], mag: &[f32]) {
    for (i, w) in want.iter().enumerate() {
        let got: f32 = parts.iter().map(|p| p[i]).sum();
        assert!(
            (got - w).abs() <= 1e-5 * mag[i] + 1e-30,
            "{what}[{i}]: ranks sum to {got}, unsplit {w}"
        );
    }
}

/// The split of `m` over `tp` ranks against the unsplit model, layer by layer (module docs).
fn check(m: &Model, tp: usize) {
    let c = &m.config;
    let plan = Plan::new(c, tp).unwrap();
    let ranks: Vec<Weights> = (0..tp).map(|r| shard(m, &plan, r).unwrap()).collect();
    let rc = plan.rank_config(c);
    let (h, hd, n) = (c.hidden, c.head_dim, 3);
    let x = rand(n * h, 7);
    let w = &m.weights;
    for l in 0..c.n_layers {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        // column-parallel: a rank's rows are the unsplit rows of its heads
        for (p, heads, share) in [
            ("attn_q", plan.heads, 1),
            ("attn_k", plan.kv_heads, plan.kv_share),
            ("attn_v", plan.kv_heads, plan.kv_share),
        ] {
            let full = prod(w, c, &b(p), None, &x, n);
            let rows = full.len() / n;
            for (r, rw) in ranks.iter().enumerate() {
                let part = prod(rw, &rc, &b(p), None, &x, n);
                let h0 = r / share * heads;
                assert_eq!(
                    part,
                    cols(&full, rows, h0 * hd..(h0 + heads) * hd),
                    "{p} rank {r}"
                );
                let bias = format!("blk.{l}.{p}.bias");
                if w.contains(&bias) {
                    let (fb, rb) = (w.get(&bias).unwrap(), rw.get(&bias).unwrap());
                    let e = fb.data.len() / fb.n_elems();
                    assert_eq!(
                        rb.data,
                        &fb.data[h0 * hd * e..(h0 + heads) * hd * e],
                        "{bias}"
                    );
                }
            }
        }
        // row-parallel O: the ranks' heads' columns, summed
        let qd = c.n_heads * hd;
        let a = rand(n * qd, 11 + l as u64);
        let span = plan.heads * hd;
        let ranges: Vec<_> = (0..tp).map(|r| r * span..(r + 1) * span).collect();
        let full = row_parallel(w, c, &b("attn_output"), None, &a, n, &ranges);
        let mag = abs_bound(w, c, &b("attn_output"), None, &a, n);
        let parts: Vec<Vec<f32>> = ranks
            .iter()
            .enumerate()
            .map(|(r, rw)| {
                let c0 = r * plan.heads * hd;
                let ar = cols(&a, qd, c0..c0 + plan.heads * hd);
                prod(rw, &rc, &b("attn_output"), None, &ar, n)
            })
            .collect();
        close_sum(&format!("layer {l} O"), &parts, &full, &mag);
        // the MLP (each expert's, for a mixture): gate and up by rows, down by columns, summed
        let experts: Vec<Option<usize>> = match c.moe {
            None => vec![None],
            Some(moe) => {
                // the router is every rank's, whole
                for rw in &ranks {
                    assert_eq!(
                        rw.get(&b("ffn_gate_inp")).unwrap().data,
                        w.get(&b("ffn_gate_inp")).unwrap().data
                    );
                }
                (0..moe.experts).step_by(5).map(Some).collect()
            }
        };
        let (g, u, d) = match c.moe {
            None => (b("ffn_gate"), b("ffn_up"), b("ffn_down")),
            Some(_) => (b("ffn_gate_exps"), b("ffn_up_exps"), b("ffn_down_exps")),
        };
        for e in experts {
            let swiglu = |gv: Vec<f32>, uv: Vec<f32>| {
                let mut uv = uv;
                ops::swiglu_inplace(&gv, &mut uv);
                uv
            };
            let hf = swiglu(prod(w, c, &g, e, &x, n), prod(w, c, &u, e, &x, n));
            let ffn = hf.len() / n;
            let ranges: Vec<_> = (0..tp).map(|r| r * plan.ffn..(r + 1) * plan.ffn).collect();
            let full = row_parallel(w, c, &d, e, &hf, n, &ranges);
            let parts: Vec<Vec<f32>> = ranks
                .iter()
                .enumerate()
                .map(|(r, rw)| {
                    let hr = swiglu(prod(rw, &rc, &g, e, &x, n), prod(rw, &rc, &u, e, &x, n));
                    assert_eq!(
                        hr,
                        cols(&hf, ffn, r * plan.ffn..(r + 1) * plan.ffn),
                        "layer {l} expert {e:?} rank {r}: gate/up rows"
                    );
                    prod(rw, &rc, &d, e, &hr, n)
                })
                .collect();
            let mag = abs_bound(w, c, &d, e, &hf, n);
            close_sum(
                &format!("layer {l} down (expert {e:?})"),
                &parts,
                &full,
                &mag,
            );
        }
    }
    // every other tensor is whole on every rank
    for rw in &ranks {
        for name in [
            "token_embd.weight",
            "output_norm.weight",
            "blk.0.attn_norm.weight",
        ] {
            assert_eq!(
                rw.get(name).unwrap().data,
                w.get(name).unwrap().data,
                "{name}"
            );
        }
    }
}

#[test]
fn shards_put_together_are_the_unsplit_model() {
    let dir = tempfile::tempdir().unwrap();
    let Some(qwen3) = synth(dir.path(), "tiny-qwen3", &[]) else {
        eprintln!("skipping: METRALE_MODEL is not set (the default model: its tokenizer)");
        return;
    };
    // 4 heads, 2 KV heads: split over 2, replicated over 4
    check(&qwen3, 2);
    check(&qwen3, 4);
    let q4 = synth(dir.path(), "tiny-qwen3", &["--quant", "q4_1"]).unwrap();
    check(&q4, 2);
    // Q/K/V biases
    check(&synth(dir.path(), "tiny-qwen2", &[]).unwrap(), 2);
    // 16 experts of FFN 128: each expert's FFN split, one KV head replicated
    let moe = synth(dir.path(), "tiny-qwen3moe", &["--quant", "q4_1"]).unwrap();
    check(&moe, 2);
    check(&moe, 4);
    // FP8 (quantized at load): row scales with their rows
    let mut fp8 = synth(dir.path(), "tiny-llama3", &[]).unwrap();
    metrale_model::fp8::quantize_at_load(&mut fp8, 2).unwrap();
    check(&fp8, 4);
}

#[test]
fn splits_that_do_not_divide_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let Some(m) = synth(dir.path(), "tiny-qwen3moe", &["--quant", "q4_1"]) else {
        return;
    };
    let e = Plan::new(&m.config, 3).unwrap_err().to_string();
    assert!(
        e.contains("query heads") && e.contains("multiple of 3"),
        "{e}"
    );
    // 8 ranks of a 128-row expert FFN: 16 columns of down each, half a Q4_1 block
    let e = match Plan::new(&m.config, 8) {
        Err(e) => e.to_string(),
        Ok(p) => shard(&m, &p, 0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default(),
    };
    assert!(
        e.contains("query heads") || e.contains("whole 32-element blocks"),
        "{e}"
    );
    let mut c = m.config.clone();
    c.n_heads = 8;
    let p = Plan::new(&c, 8).unwrap();
    assert_eq!((p.heads, p.kv_heads, p.kv_share, p.ffn), (1, 1, 8, 16));
    let e = shard(&m, &p, 0).unwrap_err().to_string();
    assert!(
        e.contains("ffn_down_exps") && e.contains("whole 32-element blocks"),
        "{e}"
    );
}
