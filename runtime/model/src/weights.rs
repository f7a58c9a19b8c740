//! Weights: named tensors in GGUF llama naming, backed by memory maps of the model files.
//!
//! Owns: the name -> (dtype, shape, bytes) table of a loaded model and the memory maps behind it.
//! Invariants:
//! - Names are GGUF names for every format (`token_embd.weight`, `blk.N.attn_q.weight`, ...); an HF
//!   mixture of experts keeps one tensor per expert, `blk.N.ffn_{gate,up,down}_exps.E.weight`, where
//!   GGUF has one 3-D `blk.N.ffn_{gate,up,down}_exps.weight`: read either through [`Weights::expert`].
//! - Shapes are in ggml order: `shape[0]` is the contiguous dimension, so a matrix is
//!   `[in_features, out_features]` and has `shape[1]` rows of `shape[0]` elements.
//! - Bytes are borrowed from the memory maps (zero-copy), except for tensors that a format needs
//!   transformed: `attn_q`/`attn_k` rows (and `attn_q_norm`/`attn_k_norm`) in HF's rope layout (every
//!   HF folder, and GGUFs of families that keep it) are permuted to GGUF llama's rope convention and
//!   are owned buffers.
//! - Every entry's byte length equals `dtype.row_bytes(shape[0]) * prod(shape[1..])` (checked when the
//!   entry is inserted).
//! - Alignment: GGUF tensor data starts at a multiple of `general.alignment` (32 by default) from
//!   the start of a page-aligned map, so it is 32-byte aligned in memory; safetensors offsets and the
//!   owned Q/K buffers carry no alignment guarantee. Read elements with `from_le_bytes` (or check
//!   alignment first), never by casting an unchecked slice.

use crate::error::{ModelError, Result};
use metrale_core::dtype::{dequantize_row, DType};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A borrowed view of one tensor.
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    /// ggml order: `shape[0]` is contiguous; a matrix is `[in_features, out_features]`.
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl<'a> TensorRef<'a> {
    /// Number of elements.
    pub fn n_elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Length of a row (the contiguous dimension).
    pub fn row_len(&self) -> usize {
        self.shape[0]
    }

    /// Number of rows (product of the other dimensions).
    pub fn n_rows(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.n_rows().max(1)
    }

    /// The bytes of row `i`.
    ///
    /// Panics if `i >= n_rows()` (like slice indexing).
    pub fn row(&self, i: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[i * rb..(i + 1) * rb]
    }

    /// Dequantize row `i` into `out` (which must be `row_len()` long).
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) -> Result<()> {
        dequantize_row(self.dtype, self.row(i), out).map_err(|source| ModelError::Numerics {
            tensor: self.name.to_string(),
            source,
        })
    }

    /// The whole tensor as f32 (allocates `n_elems()` floats).
    pub fn to_f32(&self) -> Vec<f32> {
        let n = self.row_len();
        let mut out = vec![0f32; self.n_elems()];
        for (i, o) in out.chunks_exact_mut(n).enumerate() {
            // sizes are checked when the entry is created, so this cannot fail
            dequantize_row(self.dtype, self.row(i), o).expect("tensor sizes checked at load");
        }
        out
    }
}

#[derive(Debug)]
pub(crate) enum Source {
    /// `maps[map][offset..offset + len]`
    Mapped {
        map: usize,
        offset: usize,
        len: usize,
    },
    Owned(Vec<u8>),
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub source: Source,
}

/// All tensors of a model.
pub struct Weights {
    pub(crate) path: PathBuf,
    pub(crate) maps: Vec<memmap2::Mmap>,
    pub(crate) entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("path", &self.path)
            .field("tensors", &self.entries.len())
            .field("total_bytes", &self.total_bytes())
            .finish()
    }
}

/// Expected byte size of a tensor, checked.
pub(crate) fn tensor_bytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    let row = dtype.row_bytes(*shape.first()?)?;
    shape[1..]
        .iter()
        .try_fold(row, |acc, &d| acc.checked_mul(d))
}

impl Weights {
    pub(crate) fn new(path: PathBuf, maps: Vec<memmap2::Mmap>) -> Weights {
        Weights {
            path,
            maps,
            entries: BTreeMap::new(),
        }
    }

    /// Insert an entry after checking that its bytes match its dtype and shape.
    pub(crate) fn insert(
        &mut self,
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        source: Source,
    ) -> Result<()> {
        let len = match &source {
            Source::Mapped { map, offset, len } => {
                let end = offset.checked_add(*len);
                if end.is_none_or(|e| e > self.maps[*map].len()) {
                    return Err(ModelError::Malformed {
                        path: self.path.clone(),
                        field: format!("tensor '{name}'"),
                        msg: format!(
                            "data offset {offset} + {len} bytes is past the end of the file ({} bytes)",
                            self.maps[*map].len()
                        ),
                    });
                }
                *len
            }
            Source::Owned(v) => v.len(),
        };
        let expected = tensor_bytes(dtype, &shape);
        if expected != Some(len) {
            return Err(ModelError::Mismatch {
                path: self.path.clone(),
                field: format!("tensor '{name}' size"),
                expected: match expected {
                    Some(e) => format!("{e} bytes for {dtype} {shape:?}"),
                    None => format!("a shape whose rows are whole {dtype} blocks"),
                },
                got: format!("{len} bytes"),
            });
        }
        if self
            .entries
            .insert(
                name.clone(),
                Entry {
                    dtype,
                    shape,
                    source,
                },
            )
            .is_some()
        {
            return Err(ModelError::Malformed {
                path: self.path.clone(),
                field: format!("tensor '{name}'"),
                msg: "appears twice".into(),
            });
        }
        Ok(())
    }

    /// Insert an entry in place of the one called `name`, if any (the FP8 reader's normalized
    /// scales and quantized matrices).
    pub(crate) fn replace(
        &mut self,
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        source: Source,
    ) -> Result<()> {
        self.entries.remove(&name);
        self.insert(name, dtype, shape, source)
    }

    /// Drop the tensor called `name` (a GGUF expert tensor split into one tensor per expert).
    pub(crate) fn remove(&mut self, name: &str) {
        self.entries.remove(name);
    }

    /// The tensor called `name`, or an error naming it.
    pub fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        let (key, e) =
            self.entries
                .get_key_value(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: self.path.clone(),
                    name: name.to_string(),
                    available: self.entries.len(),
                    hint: String::new(),
                })?;
        let data: &[u8] = match &e.source {
            Source::Mapped { map, offset, len } => &self.maps[*map][*offset..*offset + *len],
            Source::Owned(v) => v,
        };
        Ok(TensorRef {
            name: key,
            dtype: e.dtype,
            shape: e.shape.clone(),
            data,
        })
    }

    /// Expert `e`'s matrix of the expert tensor `name` (`blk.N.ffn_{gate,up,down}_exps.weight`):
    /// a slice of the 3-D tensor GGUF stores (`[cols, rows, experts]`, one expert's rows after
    /// another), or the expert's own tensor where the file has one per expert (the HF reader's
    /// `blk.N.ffn_{gate,up,down}_exps.E.weight`). Zero-copy either way.
    pub fn expert(&self, name: &str, e: usize) -> Result<TensorRef<'_>> {
        if let Ok(t) = self.get(name) {
            let n = t.shape.get(2).copied().unwrap_or(0);
            if t.shape.len() != 3 || e >= n {
                return Err(ModelError::Mismatch {
                    path: self.path.clone(),
                    field: format!("tensor '{name}' shape"),
                    expected: format!("[cols, rows, experts] with more than {e} experts"),
                    got: format!("{:?}", t.shape),
                });
            }
            let per = t.data.len() / n;
            return Ok(TensorRef {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape[..2].to_vec(),
                data: &t.data[e * per..(e + 1) * per],
            });
        }
        let own = match name.strip_suffix(".weight") {
            Some(base) => format!("{base}.{e}.weight"),
            None => format!("{name}.{e}"),
        };
        self.get(&own).map_err(|_| ModelError::MissingTensor {
            path: self.path.clone(),
            name: format!("{name} (or {own})"),
            available: self.entries.len(),
            hint: format!("expert {e} of a mixture-of-experts layer"),
        })
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.entries.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sum of all tensors' byte sizes.
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| match &e.source {
                Source::Mapped { len, .. } => *len as u64,
                Source::Owned(v) => v.len() as u64,
            })
            .sum()
    }

    /// Bytes of the tensors this reader had to copy (the HF reader's permuted Q/K); 0 for GGUF.
    pub fn owned_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| match &e.source {
                Source::Owned(v) => v.len() as u64,
                _ => 0,
            })
            .sum()
    }
}
