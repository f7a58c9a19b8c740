//! GGUF reader (versions 2 and 3, little-endian).
//!
//! Owns: parsing a GGUF header (metadata key/values of every type, tensor infos, alignment) from a
//! byte slice, and the typed getters the config and tokenizer use. The tensor data is not copied:
//! [`GgufFile`] keeps the memory map and [`crate::Weights`] hands out slices of it.
//!
//! Invariants (checked while parsing, so a malformed file is an error and never a panic):
//! - every read is bounds-checked; a truncated file names the field being read and its offset;
//! - no allocation is sized from an unchecked count: a count or length is first bounded by the bytes
//!   left in the file (each element takes at least its minimum encoded size);
//! - metadata arrays are stored compactly ([`Array`]): a numeric or bool array as one typed vector,
//!   a string array as one text buffer plus an end offset per string ([`StrArray`]), so an array
//!   takes no more heap than its bytes in the file (a string's 8-byte length becomes its 8-byte end
//!   offset), and parsing a header peaks at about the parsed structures' size;
//! - tensor names are unique, have 1..=4 dimensions, a supported ggml type, a row length that is a whole
//!   number of blocks, an offset aligned to `general.alignment`, and data that lies inside the file.

use crate::error::{ModelError, Result};
use metrale_core::dtype::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The GGUF magic, "GGUF" read as a little-endian u32.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Default data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: u32 = 4;

/// Metadata value types (gguf_type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    fn from_u32(v: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Smallest number of bytes one value of this type takes in the file.
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,    // u64 length
            Array => 4 + 8, // u32 type + u64 count
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// An array: all elements of one type, stored as one typed vector.
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, stored compactly: one vector of the element type (never one [`Value`] per
/// element, which took 32 bytes for a 1-byte u8).
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(StrArray),
    /// Nested arrays (at most one level), each with its own element type.
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Array {
    /// The type of the elements.
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The strings of a string array (`None` for another element type).
    pub fn as_strs(&self) -> Option<&StrArray> {
        match self {
            Array::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements as i64, if this is an integer array whose every element fits (`None` otherwise:
    /// another element type, or a u64 above i64::MAX).
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        fn all<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            Array::U8(v) => all(v, |x| Some(x.into())),
            Array::I8(v) => all(v, |x| Some(x.into())),
            Array::U16(v) => all(v, |x| Some(x.into())),
            Array::I16(v) => all(v, |x| Some(x.into())),
            Array::U32(v) => all(v, |x| Some(x.into())),
            Array::I32(v) => all(v, |x| Some(x.into())),
            Array::U64(v) => all(v, |x| i64::try_from(x).ok()),
            Array::I64(v) => Some(v.clone()),
            _ => None,
        }
    }
}

/// An array of strings as one UTF-8 buffer and the end offset of each string in it: 8 bytes of
/// overhead per string, the same as the string's length field in the file.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StrArray {
    text: String,
    ends: Vec<usize>,
}

impl StrArray {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The `i`th string.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.text.get(start..end)
    }

    /// The strings in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i).unwrap_or_default())
    }
}

impl<S: AsRef<str>> FromIterator<S> for StrArray {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> StrArray {
        let mut a = StrArray::default();
        for s in iter {
            a.text.push_str(s.as_ref());
            a.ends.push(a.text.len());
        }
        a
    }
}

impl std::fmt::Debug for StrArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Value {
    /// A short description of the value's type, for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float (f32 or f64).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for error messages: the type and value of a scalar, at most 64 characters
    /// of a string, the element type and length of an array (never all of a huge value).
    pub fn describe(&self) -> String {
        match self {
            Value::String(s) => match s.char_indices().nth(64) {
                None => format!("string {s:?}"),
                Some((cut, _)) => format!("string {:?}... ({} bytes)", &s[..cut], s.len()),
            },
            Value::Array(a) => format!("array of {} {:?}", a.len(), a.elem_type()),
            other => format!("{} {other:?}", other.type_name()),
        }
    }
}

/// One tensor's description from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// ggml order: `shape[0]` is the contiguous dimension.
    pub shape: Vec<usize>,
    /// Offset of the data from the start of the file (absolute, already checked to be in bounds).
    pub file_offset: usize,
    /// Size of the data in bytes.
    pub n_bytes: usize,
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: usize,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn err(&self, field: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Malformed {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            msg: msg.into(),
        }
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(
                field,
                format!(
                    "truncated: need {n} bytes at offset {}, the file has {} bytes",
                    self.pos,
                    self.buf.len()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let s = self.take(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A count of elements that each take at least `min_size` bytes: bounded by the bytes left.
    fn count(&mut self, field: &str, min_size: usize) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(field)?;
        let left = self.remaining() as u64;
        if n.checked_mul(min_size as u64).is_none_or(|b| b > left) {
            return Err(self.err(
                field,
                format!(
                    "count {n} at offset {at} is absurd or the file is truncated: {n} elements of at \
                     least {min_size} bytes do not fit in the {left} bytes left in the file"
                ),
            ));
        }
        Ok(n as usize)
    }

    /// A string borrowed from the file (u64 length, then UTF-8 bytes).
    fn str(&mut self, field: &str) -> Result<&'a str> {
        let at = self.pos;
        let len = self.count(field, 1)?;
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes).map_err(|e| {
            self.err(
                field,
                format!("string at offset {at} is not valid UTF-8: {e}"),
            )
        })
    }

    fn string(&mut self, field: &str) -> Result<String> {
        self.str(field).map(str::to_owned)
    }

    fn value_type(&mut self, field: &str) -> Result<ValueType> {
        let at = self.pos;
        let t = self.u32(field)?;
        ValueType::from_u32(t).ok_or_else(|| {
            self.err(
                field,
                format!("unknown value type {t} at offset {at} (known: 0..=12)"),
            )
        })
    }

    fn bool(&mut self, field: &str) -> Result<bool> {
        match self.array::<1>(field)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(field, format!("bool byte is {b}, expected 0 or 1"))),
        }
    }

    fn value(&mut self, t: ValueType, field: &str) -> Result<Value> {
        Ok(match t {
            ValueType::U8 => Value::U8(self.array::<1>(field)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(field)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => Value::U32(self.u32(field)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::Bool => Value::Bool(self.bool(field)?),
            ValueType::String => Value::String(self.string(field)?),
            ValueType::U64 => Value::U64(self.u64(field)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            ValueType::Array => Value::Array(self.array_value(field, 0)?),
        })
    }

    /// `n` fixed-size little-endian elements as one vector, allocated once at its exact size (`n`
    /// was bounded by the bytes left when it was read).
    fn fixed<const N: usize, T>(
        &mut self,
        n: usize,
        field: &str,
        from: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let bytes = self.take(n * N, field)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                from(a)
            })
            .collect())
    }

    /// `n` strings as one [`StrArray`]: a first pass checks the lengths and sums them without
    /// allocating, so the text buffer and the offsets are each allocated once at their exact size.
    fn str_array(&mut self, n: usize, field: &str) -> Result<StrArray> {
        let start = self.pos;
        let mut total = 0usize;
        for _ in 0..n {
            total += self.str(field)?.len();
        }
        self.pos = start;
        let mut a = StrArray {
            text: String::with_capacity(total),
            ends: Vec::with_capacity(n),
        };
        for _ in 0..n {
            a.text.push_str(self.str(field)?);
            a.ends.push(a.text.len());
        }
        Ok(a)
    }

    fn array_value(&mut self, field: &str, depth: u32) -> Result<Array> {
        if depth >= 2 {
            return Err(self.err(field, "arrays nested deeper than 2 levels"));
        }
        let et = self.value_type(field)?;
        let n = self.count(field, et.min_size())?;
        Ok(match et {
            ValueType::U8 => Array::U8(self.take(n, field)?.to_vec()),
            ValueType::I8 => Array::I8(self.fixed(n, field, |[b]: [u8; 1]| b as i8)?),
            ValueType::U16 => Array::U16(self.fixed(n, field, u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(n, field, i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(n, field, u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(n, field, i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(n, field, f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(n, field, u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(n, field, i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(n, field, f64::from_le_bytes)?),
            ValueType::Bool => {
                let bytes = self.take(n, field)?;
                if let Some(&b) = bytes.iter().find(|&&b| b > 1) {
                    return Err(self.err(field, format!("bool byte is {b}, expected 0 or 1")));
                }
                Array::Bool(bytes.iter().map(|&b| b == 1).collect())
            }
            ValueType::String => Array::String(self.str_array(n, field)?),
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(field, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

/// Parse a GGUF header from the whole file's bytes. `path` is used in errors only.
pub fn parse_header(buf: &[u8], path: &Path) -> Result<GgufHeader> {
    let mut r = Reader { buf, pos: 0, path };
    let magic = r.array::<4>("magic")?;
    if magic != MAGIC {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: "magic".into(),
            expected: "\"GGUF\" (a GGUF file)".into(),
            got: format!("{:?}", String::from_utf8_lossy(&magic)),
        });
    }
    let version = r.u32("version")?;
    if version != 2 && version != 3 {
        let hint = if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            " (a big-endian GGUF: only little-endian files are supported)"
        } else {
            ""
        };
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: "version".into(),
            expected: "2 or 3".into(),
            got: format!("{version}{hint}"),
        });
    }
    // A tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes; a KV at
    // least 8 (key len) + 4 (type) + 1 (value).
    let n_tensors = r.count("tensor_count", 24)?;
    let n_kv = r.count("metadata_kv_count", 13)?;
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key #{i}"))?;
        let field = format!("metadata '{key}'");
        let t = r.value_type(&field)?;
        let v = r.value(t, &field)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(r.err(&field, "duplicate metadata key"));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(ModelError::Mismatch {
                    path: path.to_path_buf(),
                    field: "metadata 'general.alignment'".into(),
                    expected: "a power of two integer between 1 and 2^20".into(),
                    got: v.describe(),
                })
            }
        },
    };

    // Tensor infos are built in place with the offset relative to the data section (fixed up below,
    // once the section's start is known); names are checked for duplicates as borrowed slices of the
    // file, so no second copy of every name is made.
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut seen = std::collections::HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.str(&format!("tensor info #{i} name"))?;
        let field = format!("tensor '{name}'");
        let n_dims = r.u32(&field)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err(
                &field,
                format!("n_dims is {n_dims}, expected 1..={MAX_DIMS}"),
            ));
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = r.u64(&field)?;
            let d = usize::try_from(d)
                .ok()
                .filter(|&d| d > 0 && d <= buf.len().saturating_mul(2).max(1 << 20))
                .ok_or_else(|| {
                    r.err(
                        &field,
                        format!("dimension {d} is absurd for a {} byte file", buf.len()),
                    )
                })?;
            shape.push(d);
        }
        let type_id = r.u32(&field)?;
        let dtype = DType::from_ggml(type_id).ok_or_else(|| ModelError::Unsupported {
            path: path.to_path_buf(),
            field: format!("{field} ggml type"),
            value: format!("{type_id} ({})", ggml_type_name(type_id)),
            supported: DType::GGUF
                .iter()
                .map(|d| format!("{} ({})", d.ggml_id().expect("a GGUF type"), d))
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        let offset = r.u64(&field)?;
        let row = dtype.row_bytes(shape[0]).ok_or_else(|| {
            r.err(
                &field,
                format!(
                    "row length {} is not a multiple of {}'s block of {}",
                    shape[0],
                    dtype,
                    dtype.block_elems()
                ),
            )
        })?;
        let n_bytes = shape[1..]
            .iter()
            .try_fold(row, |acc, &d| acc.checked_mul(d))
            .filter(|&b| b <= buf.len())
            .ok_or_else(|| {
                r.err(
                    &field,
                    format!(
                        "shape {shape:?} of {dtype} is larger than the whole file ({} bytes)",
                        buf.len()
                    ),
                )
            })?;
        if offset % alignment != 0 {
            return Err(r.err(
                &field,
                format!("data offset {offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        if !seen.insert(name) {
            return Err(r.err(&field, "duplicate tensor name"));
        }
        let offset = usize::try_from(offset).map_err(|_| {
            r.err(
                &field,
                format!("data offset {offset} is past the end of the file"),
            )
        })?;
        tensors.push(TensorInfo {
            name: name.to_owned(),
            dtype,
            shape,
            file_offset: offset,
            n_bytes,
        });
    }
    drop(seen);
    let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    for t in &mut tensors {
        let end = data_offset
            .checked_add(t.file_offset as u64)
            .and_then(|s| s.checked_add(t.n_bytes as u64));
        match end {
            Some(end) if end <= buf.len() as u64 => {}
            _ => {
                return Err(ModelError::Malformed {
                    path: path.to_path_buf(),
                    field: format!("tensor '{}'", t.name),
                    msg: format!(
                        "data offset {} + {} bytes is past the end of the file ({} bytes; data section starts at {})",
                        t.file_offset,
                        t.n_bytes,
                        buf.len(),
                        data_offset
                    ),
                })
            }
        }
        t.file_offset += data_offset as usize;
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        data_offset: data_offset as usize,
    })
}

/// ggml's name for a type id, for error messages about unsupported types.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

/// A GGUF file: its header plus the memory map its tensors point into.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: GgufHeader,
    pub(crate) map: memmap2::Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-map and parse a GGUF file. The file must not be modified while it is mapped.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = crate::files::open(path)?;
        // SAFETY: the map is read-only; the runtime's contract is that model files are not modified
        // while a server has them loaded (as for every mmap-based loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse_header(&map, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            header,
            map,
        })
    }

    /// Parse a GGUF held in memory (tests and fuzzing: no file needed). The bytes are parsed, then
    /// copied into an anonymous read-only map so the tensors point into it as they would into a file.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<GgufFile> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let header = parse_header(bytes, path)?;
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(io)?;
        map[..bytes.len()].copy_from_slice(bytes);
        Ok(GgufFile {
            path: path.to_path_buf(),
            header,
            map: map.make_read_only().map_err(io)?,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    fn mismatch(&self, key: &str, expected: &str, v: &Value) -> ModelError {
        ModelError::Mismatch {
            path: self.path.clone(),
            field: format!("metadata '{key}'"),
            expected: expected.into(),
            got: v.describe(),
        }
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::Missing {
            path: self.path.clone(),
            field: format!("metadata '{key}'"),
            hint: String::new(),
        }
    }

    /// An optional non-negative integer (any integer type).
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.mismatch(key, "a non-negative integer", v)),
        }
    }

    /// A required non-negative integer that fits usize.
    pub fn req_usize(&self, key: &str) -> Result<usize> {
        let v = self.opt_u64(key)?.ok_or_else(|| self.missing(key))?;
        usize::try_from(v)
            .map_err(|_| self.mismatch(key, "an integer that fits usize", &Value::U64(v)))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|f| Some(f as f32))
                .ok_or_else(|| self.mismatch(key, "a float", v)),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.mismatch(key, "a bool", v)),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.mismatch(key, "a string", v)),
        }
    }

    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// An optional array of strings (an empty array of any element type is an empty list).
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::String(items))) => Ok(Some(items.iter().collect())),
            Some(Value::Array(a)) if a.is_empty() => Ok(Some(Vec::new())),
            Some(v) => Err(self.mismatch(key, "an array of strings", v)),
        }
    }

    /// An optional array of integers (any integer type), as i64 (an empty array of any element type
    /// is an empty list).
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::Array(a)) => match a.to_i64s() {
                Some(ints) => Ok(Some(ints)),
                None if a.is_empty() => Ok(Some(Vec::new())),
                None => Err(self.mismatch(key, "an array of integers", v)),
            },
            Some(v) => Err(self.mismatch(key, "an array of integers", v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(o: &mut Vec<u8>, x: &str) {
        o.extend((x.len() as u64).to_le_bytes());
        o.extend(x.as_bytes());
    }

    /// A header with one key of every metadata type (and nested arrays), one F32 tensor, alignment 64.
    fn every_type() -> Vec<u8> {
        let mut o = b"GGUF".to_vec();
        o.extend(3u32.to_le_bytes());
        o.extend(1u64.to_le_bytes());
        o.extend(15u64.to_le_bytes());
        let kv = |o: &mut Vec<u8>, k: &str, t: u32, v: &[u8]| {
            s(o, k);
            o.extend(t.to_le_bytes());
            o.extend(v);
        };
        kv(&mut o, "u8", 0, &[200]);
        kv(&mut o, "i8", 1, &[(-5i8) as u8]);
        kv(&mut o, "u16", 2, &60000u16.to_le_bytes());
        kv(&mut o, "i16", 3, &(-30000i16).to_le_bytes());
        kv(&mut o, "u32", 4, &4_000_000_000u32.to_le_bytes());
        kv(&mut o, "i32", 5, &(-7i32).to_le_bytes());
        kv(&mut o, "f32", 6, &1.5f32.to_le_bytes());
        kv(&mut o, "bool", 7, &[1]);
        let mut st = Vec::new();
        s(&mut st, "héllo");
        kv(&mut o, "string", 8, &st);
        kv(&mut o, "u64", 10, &u64::MAX.to_le_bytes());
        kv(&mut o, "i64", 11, &i64::MIN.to_le_bytes());
        kv(&mut o, "f64", 12, &0.25f64.to_le_bytes());
        let mut arr = 4u32.to_le_bytes().to_vec();
        arr.extend(3u64.to_le_bytes());
        for v in [1u32, 2, 3] {
            arr.extend(v.to_le_bytes());
        }
        kv(&mut o, "arr_u32", 9, &arr);
        // array of arrays of strings
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend(2u64.to_le_bytes());
        for words in [&["a", "b"][..], &["c"][..]] {
            nested.extend(8u32.to_le_bytes());
            nested.extend((words.len() as u64).to_le_bytes());
            for w in words {
                s(&mut nested, w);
            }
        }
        kv(&mut o, "nested", 9, &nested);
        kv(&mut o, "general.alignment", 4, &64u32.to_le_bytes());
        s(&mut o, "t");
        o.extend(2u32.to_le_bytes());
        o.extend(2u64.to_le_bytes());
        o.extend(3u64.to_le_bytes());
        o.extend(0u32.to_le_bytes());
        o.extend(0u64.to_le_bytes());
        while !o.len().is_multiple_of(64) {
            o.push(0);
        }
        for i in 0..6 {
            o.extend((i as f32).to_le_bytes());
        }
        o
    }

    #[test]
    fn every_metadata_type() {
        let b = every_type();
        let h = parse_header(&b, Path::new("every.gguf")).unwrap();
        let m = &h.metadata;
        assert_eq!(m["u8"], Value::U8(200));
        assert_eq!(m["i8"], Value::I8(-5));
        assert_eq!(m["u16"], Value::U16(60000));
        assert_eq!(m["i16"], Value::I16(-30000));
        assert_eq!(m["u32"], Value::U32(4_000_000_000));
        assert_eq!(m["i32"], Value::I32(-7));
        assert_eq!(m["f32"], Value::F32(1.5));
        assert_eq!(m["bool"], Value::Bool(true));
        assert_eq!(m["string"], Value::String("héllo".into()));
        assert_eq!(m["u64"], Value::U64(u64::MAX));
        assert_eq!(m["i64"], Value::I64(i64::MIN));
        assert_eq!(m["f64"], Value::F64(0.25));
        assert_eq!(m["arr_u32"], Value::Array(Array::U32(vec![1, 2, 3])));
        match &m["nested"] {
            Value::Array(Array::Array(v)) => {
                assert_eq!(v.len(), 2);
                assert_eq!(v[0], Array::String(["a", "b"].into_iter().collect()));
                assert_eq!(v[1], Array::String(["c"].into_iter().collect()));
                assert_eq!(v[0].as_strs().unwrap().get(1), Some("b"));
                assert_eq!(v[0].elem_type(), ValueType::String);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(m["i32"].as_u64(), None);
        assert_eq!(m["i32"].as_i64(), Some(-7));
        assert_eq!(m["u8"].as_u64(), Some(200));
        assert_eq!(h.alignment, 64);
        assert_eq!(h.data_offset % 64, 0);
        assert_eq!(h.tensors.len(), 1);
        let t = &h.tensors[0];
        assert_eq!(
            (t.name.as_str(), t.dtype, t.shape.clone(), t.n_bytes),
            ("t", DType::F32, vec![2, 3], 24)
        );
        assert_eq!(
            &b[t.file_offset + 4..t.file_offset + 8],
            &1f32.to_le_bytes()
        );
        // every cut of this file is an error, never a panic
        for n in 0..b.len() {
            assert!(
                parse_header(&b[..n], Path::new("every.gguf")).is_err(),
                "cut at {n}"
            );
        }
    }

    #[test]
    fn bad_bool_and_invalid_utf8() {
        let mut b = every_type();
        let at = b.windows(4).position(|w| w == b"bool").unwrap() + 4 + 4;
        b[at] = 2;
        let e = parse_header(&b, Path::new("x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("metadata 'bool'") && e.contains("expected 0 or 1"),
            "{e}"
        );
        let mut b = every_type();
        let at = b.windows(6).position(|w| w == "héllo".as_bytes()).unwrap();
        b[at + 1] = 0xff;
        let e = parse_header(&b, Path::new("x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("metadata 'string'") && e.contains("UTF-8"),
            "{e}"
        );
    }
}
