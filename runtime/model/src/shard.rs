//! Tensor parallelism's weights: one model's tensors split over `tp` ranks Megatron-style, each
//! rank holding only its part.
//!
//! Owns: the plan of a split ([`Plan`]: per-rank heads, KV heads and FFN width, checked against the
//! model's shape and its tensors' block sizes) and a rank's tensors ([`shard`]), under the model's
//! own names, with the config that describes them ([`Plan::rank_config`]).
//!
//! The split (Megatron-LM's, as vLLM and TensorRT-LLM run it):
//! - column-parallel products (their output rows split, no communication after): Q by query
//!   heads, K and V by KV heads (or, with fewer KV heads than ranks, each rank the KV head its
//!   query heads read, replicated), gate and up by FFN rows, each routed expert's gate and up by
//!   its FFN rows; the rows' biases and FP8 row scales with them;
//! - row-parallel products (their input columns split; the ranks' outputs are summed, one
//!   all-reduce after each): O by the rank's query heads' columns, down (and each expert's down) by
//!   its FFN columns; a row's FP8 scale is whole on every rank;
//! - the rest on every rank whole: embeddings, norms (the Q/K norms are per head dimension), the
//!   router, the LM head, RoPE tables.
//!
//! So for each layer, rank r computes its heads' attention and its FFN slice, and the sum of the
//! ranks' O outputs (and of their down outputs) is the unsplit model's. (With FP8 weights each
//! rank quantizes the slice of a row-parallel product's input it holds, with its own per-token
//! scale, as vLLM does; the unsplit model's one scale a token would take an all-reduce of the
//! row's largest magnitude first.) Checked on the host by `tests/tests/tensor_parallel.rs`; the
//! ranks' processes, their NCCL all-reduces and the targets' per-rank kernels are not written yet. Invariants: a column split
//! falls on whole blocks of the tensor's type (32 elements, 256 for K-quants); a rank's tensors
//! are copies of its slices only (its memory is its share, about 1/tp of the layers).

use crate::config::{ModelConfig, Moe};
use crate::error::{ModelError, Result};
use crate::weights::{Source, Weights};
use crate::Model;

/// How a model splits over `tp` ranks (from [`Plan::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub tp: usize,
    /// Query heads per rank.
    pub heads: usize,
    /// KV heads per rank (1 where the model has fewer KV heads than ranks).
    pub kv_heads: usize,
    /// Ranks that share one KV head (1: KV heads split like query heads).
    pub kv_share: usize,
    /// FFN rows per rank (of each expert's FFN for a mixture).
    pub ffn: usize,
    head_dim: usize,
}

impl Plan {
    /// The split of `c` over `tp` ranks, or an error naming what does not divide.
    pub fn new(c: &ModelConfig, tp: usize) -> Result<Plan> {
        let bad = |field: &str, expected: String, got: String| ModelError::Mismatch {
            path: std::path::PathBuf::from(&c.name),
            field: format!("tensor parallelism over {tp}: {field}"),
            expected,
            got,
        };
        if tp == 0 {
            return Err(bad("degree", "at least 1".into(), "0".into()));
        }
        if !c.n_heads.is_multiple_of(tp) {
            return Err(bad(
                "query heads",
                format!("a multiple of {tp}"),
                c.n_heads.to_string(),
            ));
        }
        let (kv_heads, kv_share) = if c.n_kv_heads.is_multiple_of(tp) {
            (c.n_kv_heads / tp, 1)
        } else if tp.is_multiple_of(c.n_kv_heads) {
            (1, tp / c.n_kv_heads)
        } else {
            return Err(bad(
                "KV heads",
                format!("a multiple or a divisor of {tp}"),
                c.n_kv_heads.to_string(),
            ));
        };
        let ffn = c.moe.map_or(c.ffn, |m| m.ffn);
        if !ffn.is_multiple_of(tp) {
            return Err(bad(
                "FFN rows",
                format!("a multiple of {tp}"),
                ffn.to_string(),
            ));
        }
        Ok(Plan {
            tp,
            heads: c.n_heads / tp,
            kv_heads,
            kv_share,
            ffn: ffn / tp,
            head_dim: c.head_dim,
        })
    }

    /// The config of one rank's model: its heads, KV heads and FFN width; the rest as `c`.
    pub fn rank_config(&self, c: &ModelConfig) -> ModelConfig {
        let mut r = c.clone();
        r.n_heads = self.heads;
        r.n_kv_heads = self.kv_heads;
        match &mut r.moe {
            Some(m) => {
                *m = Moe {
                    ffn: self.ffn,
                    ..*m
                };
                r.ffn = self.ffn;
            }
            None => r.ffn = self.ffn,
        }
        r
    }

    /// Rank `rank`'s rows of a column-parallel tensor `name` (`rows` rows in all), or `None` for a
    /// tensor every rank holds whole or splits by columns.
    fn rows(&self, name: &str, rank: usize) -> Option<std::ops::Range<usize>> {
        let hd = self.head_dim;
        let kv = |heads: usize| {
            let h0 = rank / self.kv_share * heads;
            h0 * hd..(h0 + heads) * hd
        };
        let m = matrix_of(name)?;
        match m {
            "attn_q" => Some(rank * self.heads * hd..(rank + 1) * self.heads * hd),
            "attn_k" | "attn_v" => Some(kv(self.kv_heads)),
            "ffn_gate" | "ffn_up" | "ffn_gate_exps" | "ffn_up_exps" => {
                Some(rank * self.ffn..(rank + 1) * self.ffn)
            }
            _ => None,
        }
    }

    /// Rank `rank`'s columns of a row-parallel matrix `name`, or `None`.
    fn cols(&self, name: &str, rank: usize) -> Option<std::ops::Range<usize>> {
        let hd = self.head_dim;
        match matrix_of(name)? {
            "attn_output" => Some(rank * self.heads * hd..(rank + 1) * self.heads * hd),
            "ffn_down" | "ffn_down_exps" => Some(rank * self.ffn..(rank + 1) * self.ffn),
            _ => None,
        }
    }
}

/// The projection a layer tensor belongs to (`blk.N.attn_q.weight`, its `.bias`, its FP8
/// `.weight_scale`, an expert's `blk.N.ffn_up_exps.E.weight`: `attn_q`, `ffn_up_exps`), or `None`.
fn matrix_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("blk.")?;
    let (_, rest) = rest.split_once('.')?;
    let (m, _) = rest.split_once('.')?;
    Some(m)
}

/// Rank `rank`'s tensors of `model` split as `plan` says: a new [`Weights`] holding copies of its
/// slices under the same names (GGUF's 3-D expert tensors as one tensor per expert, the HF
/// reader's names), every other tensor whole.
pub fn shard(model: &Model, plan: &Plan, rank: usize) -> Result<Weights> {
    let w = &model.weights;
    let mut out = Weights::new(model.path.clone(), Vec::new());
    let err = |name: &str, msg: String| ModelError::Mismatch {
        path: model.path.clone(),
        field: format!("tensor '{name}' (tensor parallelism over {})", plan.tp),
        expected: msg,
        got: "a tensor that does not split there".into(),
    };
    for name in w.names() {
        let t = w.get(name)?;
        // one tensor per expert: split each
        let parts: Vec<(String, crate::TensorRef<'_>)> = if t.shape.len() == 3 {
            let base = name.strip_suffix(".weight").unwrap_or(name);
            (0..t.shape[2])
                .map(|e| Ok((format!("{base}.{e}.weight"), w.expert(name, e)?)))
                .collect::<Result<_>>()?
        } else {
            vec![(name.to_string(), t)]
        };
        for (pname, t) in parts {
            let scale_of = pname
                .strip_suffix("_scale")
                .filter(|b| b.ends_with(".weight"));
            let per_row_vector = pname.ends_with(".bias") || scale_of.is_some();
            // an FP8 static input scale is one value for the whole input: every rank's
            let whole = pname.ends_with(".input_scale");
            let (dtype, shape, bytes) = if let Some(r) = plan.rows(&pname, rank).filter(|_| !whole)
            {
                if per_row_vector {
                    // a bias or an FP8 row scale of a column-parallel matrix: its rows' values
                    if scale_of.is_some() && t.n_elems() == 1 {
                        (t.dtype, t.shape.clone(), t.data.to_vec())
                    } else {
                        let eb = t
                            .dtype
                            .row_bytes(1)
                            .ok_or_else(|| err(&pname, "a float vector, one value a row".into()))?;
                        if t.n_elems() < r.end {
                            return Err(err(&pname, format!("at least {} values", r.end)));
                        }
                        (
                            t.dtype,
                            vec![r.len()],
                            t.data[r.start * eb..r.end * eb].to_vec(),
                        )
                    }
                } else {
                    // a matrix's rows
                    let rb = t.row_bytes();
                    if t.n_rows() < r.end || t.shape.len() != 2 {
                        return Err(err(&pname, format!("a matrix of at least {} rows", r.end)));
                    }
                    (
                        t.dtype,
                        vec![t.shape[0], r.len()],
                        t.data[r.start * rb..r.end * rb].to_vec(),
                    )
                }
            } else if let Some(c) = plan
                .cols(&pname, rank)
                .filter(|_| !per_row_vector && !whole)
            {
                // a row-parallel matrix: each row's columns c, on whole blocks
                let be = t.dtype.block_elems();
                if t.shape.len() != 2 || !c.start.is_multiple_of(be) || !c.len().is_multiple_of(be)
                {
                    return Err(err(
                        &pname,
                        format!(
                            "columns {}..{} on whole {}-element blocks of {}",
                            c.start, c.end, be, t.dtype
                        ),
                    ));
                }
                let (rb, cb) = (
                    t.row_bytes(),
                    t.dtype.row_bytes(c.len()).expect("whole blocks"),
                );
                let c0 = t.dtype.row_bytes(c.start).expect("whole blocks");
                let mut v = Vec::with_capacity(t.n_rows() * cb);
                for i in 0..t.n_rows() {
                    v.extend_from_slice(&t.data[i * rb + c0..i * rb + c0 + cb]);
                }
                (t.dtype, vec![c.len(), t.n_rows()], v)
            } else {
                (t.dtype, t.shape.clone(), t.data.to_vec())
            };
            out.insert(pname, dtype, shape, Source::Owned(bytes))?;
        }
    }
    Ok(out)
}
