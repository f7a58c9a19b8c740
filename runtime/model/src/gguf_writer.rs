//! GGUF writer: the header of a GGUF v3 file (metadata, tensor descriptions) and where each
//! tensor's data goes, so that a caller can fill the data section in parallel (`write_at` at the
//! offsets [`Layout`] gives) without holding the file in memory.
//!
//! Owns: the byte encoding of [`Value`]s and tensor descriptions, data alignment
//! (`general.alignment`, default 32). It is the inverse of [`crate::gguf::parse_header`], which the
//! tests read every written file back with.

use crate::gguf::{Array, Value, DEFAULT_ALIGNMENT};
use metrale_core::dtype::DType;

/// One tensor to be written: name, element type and ggml-order shape (`shape[0]` contiguous).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Bytes of the tensor's data, or `None` when the row is not whole blocks or it overflows.
    pub fn n_bytes(&self) -> Option<usize> {
        let row = *self.shape.first()?;
        let rows = self.shape[1..]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        self.dtype.tensor_bytes(row, rows)
    }
}

/// A file's layout: the header bytes (padded to the alignment) and each tensor's absolute offset.
#[derive(Debug, Clone)]
pub struct Layout {
    pub header: Vec<u8>,
    /// Absolute file offset of each tensor's data, in the order given.
    pub offsets: Vec<u64>,
    /// Bytes of each tensor's data.
    pub sizes: Vec<usize>,
    /// Total file length.
    pub len: u64,
}

fn put_str(o: &mut Vec<u8>, s: &str) {
    o.extend((s.len() as u64).to_le_bytes());
    o.extend(s.as_bytes());
}

fn put_array(o: &mut Vec<u8>, a: &Array) {
    o.extend((a.elem_type() as u32).to_le_bytes());
    o.extend((a.len() as u64).to_le_bytes());
    match a {
        Array::U8(v) => o.extend(v),
        Array::I8(v) => o.extend(v.iter().map(|&x| x as u8)),
        Array::U16(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::I16(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::U32(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::I32(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::F32(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::Bool(v) => o.extend(v.iter().map(|&x| x as u8)),
        Array::String(v) => v.iter().for_each(|s| put_str(o, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(o, a)),
        Array::U64(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::I64(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
        Array::F64(v) => v.iter().for_each(|x| o.extend(x.to_le_bytes())),
    }
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(o: &mut Vec<u8>, v: &Value) {
    o.extend(value_type(v).to_le_bytes());
    match v {
        Value::U8(x) => o.push(*x),
        Value::I8(x) => o.push(*x as u8),
        Value::U16(x) => o.extend(x.to_le_bytes()),
        Value::I16(x) => o.extend(x.to_le_bytes()),
        Value::U32(x) => o.extend(x.to_le_bytes()),
        Value::I32(x) => o.extend(x.to_le_bytes()),
        Value::F32(x) => o.extend(x.to_le_bytes()),
        Value::Bool(x) => o.push(*x as u8),
        Value::String(s) => put_str(o, s),
        Value::Array(a) => put_array(o, a),
        Value::U64(x) => o.extend(x.to_le_bytes()),
        Value::I64(x) => o.extend(x.to_le_bytes()),
        Value::F64(x) => o.extend(x.to_le_bytes()),
    }
}

/// Lay out a GGUF v3 file: `metadata` in the order given (a `general.alignment` entry, if any, sets
/// the alignment), then the tensor descriptions, then each tensor's data at an aligned offset.
pub fn layout(metadata: &[(String, Value)], tensors: &[TensorSpec]) -> Result<Layout, String> {
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        Some((_, Value::U32(a))) if a.is_power_of_two() => *a as u64,
        Some((_, v)) => {
            return Err(format!(
                "general.alignment must be a u32 power of two, got {v:?}"
            ))
        }
        None => DEFAULT_ALIGNMENT,
    };
    let mut o = Vec::new();
    o.extend(b"GGUF");
    o.extend(3u32.to_le_bytes());
    o.extend((tensors.len() as u64).to_le_bytes());
    o.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut o, k);
        put_value(&mut o, v);
    }
    let mut rel = 0u64;
    let mut rels = Vec::with_capacity(tensors.len());
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t.n_bytes().ok_or_else(|| {
            format!(
                "tensor {}: shape {:?} is not whole {} blocks",
                t.name, t.shape, t.dtype
            )
        })?;
        put_str(&mut o, &t.name);
        o.extend((t.shape.len() as u32).to_le_bytes());
        for &d in &t.shape {
            o.extend((d as u64).to_le_bytes());
        }
        let id = t.dtype.ggml_id().ok_or_else(|| {
            format!(
                "tensor {}: GGUF has no {} type; write FP8 checkpoints as HF safetensors",
                t.name, t.dtype
            )
        })?;
        o.extend(id.to_le_bytes());
        o.extend(rel.to_le_bytes());
        rels.push(rel);
        sizes.push(n);
        rel += (n as u64).div_ceil(alignment) * alignment;
    }
    o.resize(
        (o.len() as u64).div_ceil(alignment) as usize * alignment as usize,
        0,
    );
    let base = o.len() as u64;
    Ok(Layout {
        offsets: rels.iter().map(|r| base + r).collect(),
        len: base + rel,
        sizes,
        header: o,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{parse_header, StrArray};

    #[test]
    fn written_header_reads_back() {
        let meta = vec![
            (
                "general.architecture".to_string(),
                Value::String("llama".into()),
            ),
            ("llama.block_count".into(), Value::U32(2)),
            ("x.f".into(), Value::F32(0.5)),
            ("x.b".into(), Value::Bool(true)),
            ("x.u64".into(), Value::U64(1 << 40)),
            (
                "x.strs".into(),
                Value::Array(Array::String(
                    ["a", "", "héllo"].into_iter().collect::<StrArray>(),
                )),
            ),
            ("x.i32s".into(), Value::Array(Array::I32(vec![1, -2, 3]))),
        ];
        let tensors = vec![
            TensorSpec {
                name: "a".into(),
                dtype: DType::Q4_1,
                shape: vec![64, 3],
            },
            TensorSpec {
                name: "b".into(),
                dtype: DType::F32,
                shape: vec![5],
            },
            TensorSpec {
                name: "c".into(),
                dtype: DType::BF16,
                shape: vec![7, 2],
            },
        ];
        let l = layout(&meta, &tensors).unwrap();
        let mut file = l.header.clone();
        file.resize(l.len as usize, 0);
        let h = parse_header(&file, std::path::Path::new("t.gguf")).unwrap();
        assert_eq!(h.version, 3);
        for (k, v) in &meta {
            assert_eq!(h.metadata.get(k), Some(v), "{k}");
        }
        for (i, t) in tensors.iter().enumerate() {
            let r = &h.tensors[i];
            assert_eq!((&r.name, r.dtype, &r.shape), (&t.name, t.dtype, &t.shape));
            assert_eq!(r.file_offset as u64, l.offsets[i]);
            assert_eq!(r.n_bytes, l.sizes[i]);
            assert_eq!(l.offsets[i] % 32, 0);
        }
        assert_eq!(l.sizes, vec![2 * 20 * 3, 20, 28]);
        assert!(layout(
            &meta,
            &[TensorSpec {
                name: "bad".into(),
                dtype: DType::Q8_0,
                shape: vec![33]
            }]
        )
        .is_err());
    }
}
