//! The weights of a CUDA target on the device: each GGUF tensor checked against the shape the
//! kernels were compiled for, repacked once into the device layouts of `kernels/cuda/common.cuh`
//! (Q4_1 nibbles and (d, m) pairs split and stored in panels of K, Q8_0 int8 and scales split, bf16
//! as is; q/k/v stacked, gate/up interleaved) and uploaded, with the model tables the kernels read (final norm, the RoPE
//! cos/sin table of `crate::rope`).
//!
//! Invariants: a checkpoint whose shape differs from the compiled one is refused naming the field;
//! repacking is exact for Q4_1 and Q8_0 (bytes moved, no rounding) and rounds to bf16 otherwise.

use half::bf16;
use metrale_core::dtype::{bf16_to_f32, dequantize_row, f16_to_f32, DType, QK};
use metrale_core::fp8::Activations;
use metrale_core::shape::Dims;
use metrale_core::target::Features;
use metrale_core::BackendError;
use metrale_model::{ModelConfig, Weights};

use super::device::{DevBuf, Device};
use super::launch::MoeShape;

fn model_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Model(e.to_string())
}

/// A weight matrix in a device layout, still on the host: `rows` rows of `k` elements; `qs` holds
/// `qs_row` bytes per row, `sc` holds `sc_row` bytes per row (empty for bf16), row-major. The
/// upload puts Q4_1 in its panels ([`HostMat::panelled`]).
#[derive(Debug, Clone, PartialEq)]
pub struct HostMat {
    pub format: DevFormat,
    pub rows: usize,
    pub k: usize,
    pub qs: Vec<u8>,
    pub sc: Vec<u8>,
}

/// Device weight formats (common.cuh: WQ41, WQ80, WBF16, WF8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevFormat {
    Q4_1,
    Q8_0,
    Bf16,
    /// FP8 e4m3 rows (`qs`: the bytes as the checkpoint stores them) and one f32 scale per row
    /// (`sc`), `metrale_core::fp8`'s format.
    Fp8,
}

impl DevFormat {
    /// The format a quant's `weights` / `embedding` string names.
    pub fn from_quant_name(s: &str) -> Option<DevFormat> {
        match s {
            "q4_1" => Some(DevFormat::Q4_1),
            "q8_0" => Some(DevFormat::Q8_0),
            "bf16" => Some(DevFormat::Bf16),
            "fp8" => Some(DevFormat::Fp8),
            _ => None,
        }
    }
    fn qs_row(self, k: usize) -> usize {
        match self {
            DevFormat::Q4_1 => k / 2,
            DevFormat::Q8_0 => k,
            DevFormat::Bf16 => 2 * k,
            DevFormat::Fp8 => k,
        }
    }
    fn sc_row(self, k: usize) -> usize {
        match self {
            DevFormat::Q4_1 => (k / QK) * 4,
            DevFormat::Q8_0 => (k / QK) * 2,
            DevFormat::Bf16 => 0,
            DevFormat::Fp8 => 4,
        }
    }
}

/// Why a tensor cannot be put in a device format.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RepackError {
    #[error("tensor {tensor}: the {format:?} device layout needs {expected} data, got {got}; build the target whose quant matches the checkpoint, or a bf16 one (it converts every GGUF type at load)")]
    WrongDtype {
        tensor: String,
        format: DevFormat,
        expected: &'static str,
        got: DType,
    },
    #[error("tensor {tensor}: {what}: expected {expected}, got {got}")]
    Shape {
        tensor: String,
        what: &'static str,
        expected: usize,
        got: usize,
    },
}

impl HostMat {
    pub fn qs_row(&self) -> usize {
        self.format.qs_row(self.k)
    }
    pub fn sc_row(&self) -> usize {
        self.format.sc_row(self.k)
    }

    /// Repack `rows` rows of `k` elements of GGUF data `data` (dtype `dtype`) into `format`.
    /// Q4_1 and Q8_0 are split into their nibble/int8 bytes and their scales unchanged (no rounding);
    /// bf16 accepts any float or quantized type and rounds each dequantised value to bf16 (exact for
    /// BF16 input).
    pub fn repack(
        tensor: &str,
        format: DevFormat,
        dtype: DType,
        rows: usize,
        k: usize,
        data: &[u8],
    ) -> Result<HostMat, RepackError> {
        if !k.is_multiple_of(QK) {
            return Err(RepackError::Shape {
                tensor: tensor.into(),
                what: "row length (multiple of 32)",
                expected: k.next_multiple_of(QK),
                got: k,
            });
        }
        let want = dtype.tensor_bytes(k, rows).unwrap_or(usize::MAX);
        if data.len() != want {
            return Err(RepackError::Shape {
                tensor: tensor.into(),
                what: "bytes",
                expected: want,
                got: data.len(),
            });
        }
        let nb = k / QK;
        let mut qs = Vec::with_capacity(rows * format.qs_row(k));
        let mut sc = Vec::with_capacity(rows * format.sc_row(k));
        match format {
            DevFormat::Q4_1 => {
                if dtype != DType::Q4_1 {
                    return Err(RepackError::WrongDtype {
                        tensor: tensor.into(),
                        format,
                        expected: "q4_1",
                        got: dtype,
                    });
                }
                for b in data.chunks_exact(20).take(rows * nb) {
                    sc.extend_from_slice(&b[0..4]); // f16 d, f16 m == half2 (d, m)
                    qs.extend_from_slice(&b[4..20]);
                }
            }
            DevFormat::Q8_0 => {
                if dtype != DType::Q8_0 {
                    return Err(RepackError::WrongDtype {
                        tensor: tensor.into(),
                        format,
                        expected: "q8_0",
                        got: dtype,
                    });
                }
                for b in data.chunks_exact(34).take(rows * nb) {
                    sc.extend_from_slice(&b[0..2]);
                    qs.extend_from_slice(&b[2..34]);
                }
            }
            DevFormat::Fp8 => {
                return Err(RepackError::WrongDtype {
                    tensor: tensor.into(),
                    format,
                    expected: "f8_e4m3 with its scales (HostMat::fp8)",
                    got: dtype,
                })
            }
            DevFormat::Bf16 => {
                if dtype == DType::BF16 {
                    qs.extend_from_slice(data);
                } else {
                    let rb = data.len() / rows.max(1);
                    let mut row = vec![0f32; k];
                    for r in 0..rows {
                        dequantize_row(dtype, &data[r * rb..(r + 1) * rb], &mut row).map_err(
                            |_| RepackError::Shape {
                                tensor: tensor.into(),
                                what: "row bytes",
                                expected: rb,
                                got: rb,
                            },
                        )?;
                        for v in &row {
                            qs.extend_from_slice(&bf16::from_f32(*v).to_le_bytes());
                        }
                    }
                }
            }
        }
        Ok(HostMat {
            format,
            rows,
            k,
            qs,
            sc,
        })
    }

    /// An FP8 matrix: `rows` rows of `k` e4m3 bytes (`data`, row-major) and one f32 scale per row,
    /// as they are (no rounding).
    pub fn fp8(
        tensor: &str,
        rows: usize,
        k: usize,
        data: &[u8],
        scales: &[f32],
    ) -> Result<HostMat, RepackError> {
        for (what, expected, got) in [
            ("row length (multiple of 32)", k.next_multiple_of(QK), k),
            ("bytes", rows * k, data.len()),
            ("scales (one a row)", rows, scales.len()),
        ] {
            if expected != got {
                return Err(RepackError::Shape {
                    tensor: tensor.into(),
                    what,
                    expected,
                    got,
                });
            }
        }
        Ok(HostMat {
            format: DevFormat::Fp8,
            rows,
            k,
            qs: data.to_vec(),
            sc: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        })
    }

    /// Stack matrices of the same format and row length row-wise (q, k, v -> qkv).
    pub fn concat_rows(name: &str, parts: &[HostMat]) -> Result<HostMat, RepackError> {
        let first = &parts[0];
        let mut out = HostMat {
            format: first.format,
            rows: 0,
            k: first.k,
            qs: Vec::new(),
            sc: Vec::new(),
        };
        for p in parts {
            if p.k != first.k {
                return Err(RepackError::Shape {
                    tensor: name.into(),
                    what: "row length of a stacked part",
                    expected: first.k,
                    got: p.k,
                });
            }
            out.rows += p.rows;
            out.qs.extend_from_slice(&p.qs);
            out.sc.extend_from_slice(&p.sc);
        }
        Ok(out)
    }

    /// Interleave two matrices row by row: row 2i = a's row i, row 2i+1 = b's row i (gate/up).
    pub fn interleave_rows(name: &str, a: &HostMat, b: &HostMat) -> Result<HostMat, RepackError> {
        if a.k != b.k || a.rows != b.rows {
            return Err(RepackError::Shape {
                tensor: name.into(),
                what: "rows of the interleaved pair",
                expected: a.rows,
                got: b.rows,
            });
        }
        let (qr, sr) = (a.qs_row(), a.sc_row());
        let mut out = HostMat {
            format: a.format,
            rows: 2 * a.rows,
            k: a.k,
            qs: Vec::with_capacity(2 * a.qs.len()),
            sc: Vec::with_capacity(2 * a.sc.len()),
        };
        for r in 0..a.rows {
            out.qs.extend_from_slice(&a.qs[r * qr..(r + 1) * qr]);
            out.qs.extend_from_slice(&b.qs[r * qr..(r + 1) * qr]);
            out.sc.extend_from_slice(&a.sc[r * sr..(r + 1) * sr]);
            out.sc.extend_from_slice(&b.sc[r * sr..(r + 1) * sr]);
        }
        Ok(out)
    }

    /// The bytes as the kernels read them: Q4_1 in panels of `P = layout::q41_panel(k)` blocks of
    /// K, each panel row-major over all the rows (block `b` of row `r` at `(b / P) * rows * P +
    /// r * P + b % P`, in the nibbles and in the (d, m) pairs alike), so that one warp-specialised
    /// GEMM stage of a tile of rows is one contiguous span; the other formats as they are. Where
    /// `P` is the whole row, the panelled layout is the row-major one.
    pub fn panelled(&self) -> (std::borrow::Cow<'_, [u8]>, std::borrow::Cow<'_, [u8]>) {
        use std::borrow::Cow;
        let nb = self.k / QK;
        let p = metrale_abi::layout::q41_panel(self.k);
        if self.format != DevFormat::Q4_1 || p == nb {
            return (Cow::Borrowed(&self.qs), Cow::Borrowed(&self.sc));
        }
        let panel = |src: &[u8], unit: usize| {
            let mut out = Vec::with_capacity(src.len());
            for c in 0..nb / p {
                for r in 0..self.rows {
                    let at = (r * nb + c * p) * unit;
                    out.extend_from_slice(&src[at..at + p * unit]);
                }
            }
            out
        };
        (
            Cow::Owned(panel(&self.qs, 16)),
            Cow::Owned(panel(&self.sc, 4)),
        )
    }

    /// Dequantise row `r` from the device layout (tests: the inverse of `repack`).
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let nb = self.k / QK;
        let q = &self.qs[r * self.qs_row()..(r + 1) * self.qs_row()];
        let s = &self.sc[r * self.sc_row()..(r + 1) * self.sc_row()];
        let mut out = vec![0f32; self.k];
        match self.format {
            DevFormat::Q4_1 => {
                for b in 0..nb {
                    let d = f16_to_f32(u16::from_le_bytes([s[4 * b], s[4 * b + 1]]));
                    let m = f16_to_f32(u16::from_le_bytes([s[4 * b + 2], s[4 * b + 3]]));
                    for j in 0..16 {
                        let byte = q[16 * b + j];
                        out[32 * b + j] = (byte & 15) as f32 * d + m;
                        out[32 * b + j + 16] = (byte >> 4) as f32 * d + m;
                    }
                }
            }
            DevFormat::Q8_0 => {
                for b in 0..nb {
                    let d = f16_to_f32(u16::from_le_bytes([s[2 * b], s[2 * b + 1]]));
                    for j in 0..32 {
                        out[32 * b + j] = (q[32 * b + j] as i8) as f32 * d;
                    }
                }
            }
            DevFormat::Bf16 => {
                for (o, c) in out.iter_mut().zip(q.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            DevFormat::Fp8 => {
                let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                for (o, &b) in out.iter_mut().zip(q) {
                    *o = metrale_core::fp8::e4m3_to_f32(b) * scale;
                }
            }
        }
        out
    }
}

/// A weight matrix on the device (the layout of [`HostMat`]).
pub struct DevMat {
    pub qs: DevBuf,
    pub sc: Option<DevBuf>,
    pub rows: usize,
    pub k: usize,
}

impl DevMat {
    pub fn upload(dev: &Device, m: &HostMat) -> Result<DevMat, BackendError> {
        let (qs, sc) = m.panelled();
        let qs = dev.upload(&qs[..])?;
        let sc = if sc.is_empty() {
            None
        } else {
            Some(dev.upload(&sc[..])?)
        };
        Ok(DevMat {
            qs,
            sc,
            rows: m.rows,
            k: m.k,
        })
    }
    /// The scales' pointer (0 for bf16, which has none).
    pub fn sc_ptr(&self) -> u64 {
        self.sc.as_ref().map(|b| b.ptr).unwrap_or(0)
    }
    pub fn bytes(&self) -> usize {
        self.qs.bytes + self.sc.as_ref().map(|b| b.bytes).unwrap_or(0)
    }
}

/// One layer's weights on the device.
pub struct LayerW {
    pub attn_norm: DevBuf,
    /// Families with `qk_norm`: the Q heads' norm weights then the K heads' (`head_dim` f32 each).
    pub qk_norm: Option<DevBuf>,
    /// Families with `qkv_bias`: the Q, K and V projections' biases, f32 `[qd + 2 kd]` (the rows
    /// of `wqkv`).
    pub qkv_bias: Option<DevBuf>,
    /// Families with routed experts: the router, f32 `[experts][hidden]`; `wgu` and `wdown` then
    /// hold every expert's matrices stacked by expert (`moe.cu.hbs`).
    pub router: Option<DevBuf>,
    /// The router's columns times the FFN norm's weights, f32 `[hidden][experts]`
    /// ([`router_columns`]): `moe_out_route`'s, which routes a one-token step as its O product
    /// writes the residual.
    pub router_cols: Option<DevBuf>,
    pub wqkv: DevMat,
    pub wo: DevMat,
    pub ffn_norm: DevBuf,
    pub wgu: DevMat,
    pub wdown: DevMat,
}

/// The router's columns scaled by the FFN norm's weights: `out[r * experts + e] = router[e *
/// hidden + r] * ffn_norm[r]` (`router`: `[experts][hidden]`). A router logit is then
/// `sum_r out[r][e] * x[r]` times the norm's `1 / rms(x)`: a sum over the residual's rows, which
/// `moe_out_route` adds up as it writes them.
pub fn router_columns(router: &[f32], ffn_norm: &[f32]) -> Vec<f32> {
    let hidden = ffn_norm.len();
    let experts = router.len() / hidden.max(1);
    let mut out = vec![0f32; router.len()];
    for (e, row) in router.chunks_exact(hidden).enumerate() {
        for (r, (&w, &g)) in row.iter().zip(ffn_norm).enumerate() {
            out[r * experts + e] = w * g;
        }
    }
    out
}

impl LayerW {
    /// Its entry in `decode_1`'s per-layer pointer table.
    pub fn ptrs(&self) -> metrale_abi::device::LayerW {
        metrale_abi::device::LayerW {
            attn_norm: self.attn_norm.ptr,
            qkv_qs: self.wqkv.qs.ptr,
            qkv_sc: self.wqkv.sc_ptr(),
            o_qs: self.wo.qs.ptr,
            o_sc: self.wo.sc_ptr(),
            ffn_norm: self.ffn_norm.ptr,
            gu_qs: self.wgu.qs.ptr,
            gu_sc: self.wgu.sc_ptr(),
            down_qs: self.wdown.qs.ptr,
            down_sc: self.wdown.sc_ptr(),
        }
    }
}

/// Every weight of the model on the device, and the tables the kernels read.
pub struct ModelWeights {
    pub emb: DevMat,
    /// `None` when the LM head is tied to the embedding.
    pub out: Option<DevMat>,
    pub out_norm: DevBuf,
    /// (cos, sin) per position and pair: `crate::rope::rope_table`, `positions` rows.
    pub rope: DevBuf,
    pub layers: Vec<LayerW>,
    /// The routed experts of every layer, if the family has them.
    pub moe: Option<MoeShape>,
}

/// Refuse a checkpoint whose family or shape is not the one the kernels were compiled for.
pub fn check_config(
    c: &ModelConfig,
    d: &Dims,
    (family, moe): (&str, Option<MoeShape>),
    (target, wf): (&str, DevFormat),
) -> Result<(), BackendError> {
    if c.family.name() != family {
        return Err(BackendError::Model(format!(
            "model {}: the {} family, but this binary's kernels ({target}) compute the {family} \
             block; build a target for a {} model",
            c.name, c.family, c.family
        )));
    }
    if c.rotary_dim != c.head_dim
        || matches!(
            c.rope_scaling,
            Some(metrale_model::RopeScaling::LongRope { .. })
                | Some(metrale_model::RopeScaling::Yarn { .. })
        )
    {
        return Err(BackendError::Model(format!(
            "model {}: a partial rotary embedding ({} of {} dimensions), LongRoPE or YaRN, which this \
             binary's kernels ({target}) do not compute; serve it with the cpu backend",
            c.name, c.rotary_dim, c.head_dim
        )));
    }
    match c.fp8 {
        Some(_) if wf != DevFormat::Fp8 => {
            return Err(BackendError::Model(format!(
                "model {}: FP8 weights, but this binary's kernels ({target}) read {wf:?} layer \
                 matrices; build the model's fp8 target (--quant fp8), or serve it with the cpu \
                 backend",
                c.name
            )))
        }
        Some(a @ (Activations::Static | Activations::Dynamic { ub: Some(_) })) => {
            return Err(BackendError::Model(format!(
                "model {}: FP8 products with {a}, but this binary's kernels ({target}) quantize \
                 each token's row by its own largest magnitude, uncapped; serve it with the cpu \
                 backend, or quantize the bf16 checkpoint at load (--quantization fp8)",
                c.name
            )))
        }
        _ => {}
    }
    if let Some(sw) = &c.sliding {
        return Err(BackendError::Model(format!(
            "model {}: sliding-window attention ({} positions), which this binary's kernels \
             ({target}) do not compute; serve it with the cpu backend",
            c.name, sw.window
        )));
    }
    if (c.attn_scale * (c.head_dim as f32).sqrt() - 1.0).abs() > 1e-6 {
        return Err(BackendError::Model(format!(
            "model {}: attention scores scaled by {}, not 1/sqrt(head_dim) as this binary's \
             kernels ({target}) scale them; serve it with the cpu backend",
            c.name, c.attn_scale
        )));
    }
    let got = c.moe.map(|m| (m.experts, m.used, m.ffn, m.norm_topk));
    let want = moe.map(|m| (m.experts, m.used, m.ffn, true));
    if got != want {
        return Err(BackendError::Model(format!(
            "model {}: routed experts (count, used, ffn, renormalised) {got:?}, but this binary's \
             kernels ({target}) are compiled for {want:?}; build the target for this model",
            c.name
        )));
    }
    let pairs = [
        ("layers", c.n_layers, d.layers),
        ("hidden", c.hidden, d.hidden),
        ("heads", c.n_heads, d.heads),
        ("kv_heads", c.n_kv_heads, d.kv_heads),
        ("head_dim", c.head_dim, d.head_dim),
        ("ffn", c.ffn, d.ffn),
        ("vocab", c.vocab, d.vocab),
    ];
    for (field, got, want) in pairs {
        // a mixture's checkpoint states its experts' width; the target's `ffn` is the dense width
        // its config also carries (unused), checked above as the experts' shape
        if field == "ffn" && moe.is_some() {
            continue;
        }
        if got != want {
            return Err(BackendError::Model(format!(
                "model {}: {field} is {got}, but this binary's kernels ({target}) are compiled for {want}; build the target for this model",
                c.name
            )));
        }
    }
    Ok(())
}

/// Expert `e`'s matrix of the experts' tensor `name` (GGUF: one 3-D tensor; HF: one a expert,
/// `Weights::expert`), checked to be `rows` x `k`, repacked to `fmt`.
fn expert_mat(
    w: &Weights,
    name: &str,
    e: usize,
    fmt: DevFormat,
    rows: usize,
    k: usize,
) -> Result<HostMat, BackendError> {
    let t = w.expert(name, e).map_err(model_err)?;
    if t.row_len() != k || t.n_rows() != rows {
        return Err(BackendError::Model(format!(
            "tensor {name} expert {e}: expected {rows} rows of {k}, got {} rows of {}",
            t.n_rows(),
            t.row_len()
        )));
    }
    if fmt == DevFormat::Fp8 {
        return Err(BackendError::Model(format!(
            "tensor {name}: routed experts in fp8, which this binary's kernels do not compute; \
             serve the mixture with the cpu backend, or its bf16 checkpoint with a bf16 target"
        )));
    }
    HostMat::repack(name, fmt, t.dtype, rows, k, t.data).map_err(model_err)
}

/// A weight matrix from `weights`, checked to be `rows` x `k`, repacked to `fmt`.
fn host_mat(
    w: &Weights,
    name: &str,
    fmt: DevFormat,
    rows: usize,
    k: usize,
) -> Result<HostMat, BackendError> {
    let t = w.get(name).map_err(model_err)?;
    if t.row_len() != k || t.n_rows() != rows {
        return Err(BackendError::Model(format!(
            "tensor {name}: expected {rows} rows of {k}, got {} rows of {}",
            t.n_rows(),
            t.row_len()
        )));
    }
    if fmt == DevFormat::Fp8 {
        if t.dtype != DType::F8_E4M3 {
            return Err(BackendError::Model(format!(
                "tensor {name}: {}, but this binary's kernels read fp8 (e4m3) layer matrices: \
                 serve an FP8 checkpoint, or quantize this one at load with --quantization fp8",
                t.dtype
            )));
        }
        let scales = host_vec(w, &metrale_model::fp8::scale_name(name), rows)?;
        return HostMat::fp8(name, rows, k, t.data, &scales).map_err(model_err);
    }
    if t.dtype == DType::F8_E4M3 {
        // its scales are a tensor of their own, which only the fp8 layout carries
        return Err(BackendError::Model(format!(
            "tensor {name}: FP8, but this binary's kernels read it as {fmt:?} (the fp8 targets \
             keep the embedding and the LM head in bf16); serve this checkpoint with the cpu \
             backend"
        )));
    }
    HostMat::repack(name, fmt, t.dtype, rows, k, t.data).map_err(model_err)
}

pub(super) fn host_vec(w: &Weights, name: &str, n: usize) -> Result<Vec<f32>, BackendError> {
    let t = w.get(name).map_err(model_err)?;
    if t.n_elems() != n {
        return Err(BackendError::Model(format!(
            "tensor {name}: expected {n} elements, got {}",
            t.n_elems()
        )));
    }
    Ok(t.to_f32())
}

/// One layer's weights repacked on the host, ready to upload.
struct HostLayer {
    attn_norm: Vec<f32>,
    qk_norm: Option<Vec<f32>>,
    qkv_bias: Option<Vec<f32>>,
    router: Option<Vec<f32>>,
    wqkv: HostMat,
    wo: HostMat,
    ffn_norm: Vec<f32>,
    wgu: HostMat,
    wdown: HostMat,
}

impl HostLayer {
    fn read(
        w: &Weights,
        d: &Dims,
        wf: DevFormat,
        (f, moe): (Features, Option<MoeShape>),
        l: usize,
    ) -> Result<HostLayer, BackendError> {
        let (hd, qd, kd) = (d.hidden, d.qd(), d.kd());
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let wq = host_mat(w, &n("attn_q"), wf, qd, hd)?;
        let wk = host_mat(w, &n("attn_k"), wf, kd, hd)?;
        let wv = host_mat(w, &n("attn_v"), wf, kd, hd)?;
        let (router, wgu, wdown) = match moe {
            None => {
                let wg = host_mat(w, &n("ffn_gate"), wf, d.ffn, hd)?;
                let wu = host_mat(w, &n("ffn_up"), wf, d.ffn, hd)?;
                (
                    None,
                    HostMat::interleave_rows(&n("ffn_gate_up"), &wg, &wu).map_err(model_err)?,
                    host_mat(w, &n("ffn_down"), wf, hd, d.ffn)?,
                )
            }
            Some(m) => {
                let router = host_vec(w, &n("ffn_gate_inp"), m.experts * hd)?;
                let mut gu = Vec::with_capacity(m.experts);
                let mut down = Vec::with_capacity(m.experts);
                for e in 0..m.experts {
                    let g = expert_mat(w, &n("ffn_gate_exps"), e, wf, m.ffn, hd)?;
                    let u = expert_mat(w, &n("ffn_up_exps"), e, wf, m.ffn, hd)?;
                    gu.push(
                        HostMat::interleave_rows(&n("ffn_gate_up_exps"), &g, &u)
                            .map_err(model_err)?,
                    );
                    down.push(expert_mat(w, &n("ffn_down_exps"), e, wf, hd, m.ffn)?);
                }
                (
                    Some(router),
                    HostMat::concat_rows(&n("ffn_gate_up_exps"), &gu).map_err(model_err)?,
                    HostMat::concat_rows(&n("ffn_down_exps"), &down).map_err(model_err)?,
                )
            }
        };
        let qk_norm = if f.qk_norm {
            let mut v = host_vec(w, &n("attn_q_norm"), d.head_dim)?;
            v.extend(host_vec(w, &n("attn_k_norm"), d.head_dim)?);
            Some(v)
        } else {
            None
        };
        let qkv_bias = if f.qkv_bias {
            let b = |s: &str, len| host_vec(w, &format!("blk.{l}.{s}.bias"), len);
            let mut v = b("attn_q", qd)?;
            v.extend(b("attn_k", kd)?);
            v.extend(b("attn_v", kd)?);
            Some(v)
        } else {
            None
        };
        Ok(HostLayer {
            attn_norm: host_vec(w, &n("attn_norm"), hd)?,
            qk_norm,
            qkv_bias,
            router,
            wqkv: HostMat::concat_rows(&n("attn_qkv"), &[wq, wk, wv]).map_err(model_err)?,
            wo: host_mat(w, &n("attn_output"), wf, hd, qd)?,
            ffn_norm: host_vec(w, &n("ffn_norm"), hd)?,
            wgu,
            wdown,
        })
    }

    fn upload(&self, dev: &Device) -> Result<LayerW, BackendError> {
        Ok(LayerW {
            attn_norm: dev.upload(&self.attn_norm)?,
            qk_norm: self.qk_norm.as_deref().map(|v| dev.upload(v)).transpose()?,
            qkv_bias: self
                .qkv_bias
                .as_deref()
                .map(|v| dev.upload(v))
                .transpose()?,
            router: self.router.as_deref().map(|v| dev.upload(v)).transpose()?,
            router_cols: self
                .router
                .as_deref()
                .map(|r| dev.upload(&router_columns(r, &self.ffn_norm)))
                .transpose()?,
            wqkv: DevMat::upload(dev, &self.wqkv)?,
            wo: DevMat::upload(dev, &self.wo)?,
            ffn_norm: dev.upload(&self.ffn_norm)?,
            wgu: DevMat::upload(dev, &self.wgu)?,
            wdown: DevMat::upload(dev, &self.wdown)?,
        })
    }
}

/// What one host worker prepares: the embedding, the untied LM head or a layer.
enum HostPart {
    Mat(HostMat),
    Layer(Box<HostLayer>),
}

impl ModelWeights {
    /// Repack and upload `weights` (shape `d`; layer matrices in `wf`, embedding and LM head in
    /// `ef`) with a RoPE table of `positions` rows. Host threads read and repack the embedding, the
    /// head and the layers (a few ahead), while this thread uploads them in order: reading and
    /// repacking on one thread ran at ~1 GB/s, 16 s of a 16 GB model's start.
    pub fn load(
        dev: &Device,
        d: &Dims,
        (wf, ef): (DevFormat, DevFormat),
        config: &ModelConfig,
        weights: &Weights,
        positions: usize,
    ) -> Result<ModelWeights, BackendError> {
        let hd = d.hidden;
        let moe = config.moe.map(|m| MoeShape {
            experts: m.experts,
            used: m.used,
            ffn: m.ffn,
        });
        let untied = weights.contains("output.weight");
        // item 0: the embedding, 1: the untied head (when there is one), then the layers
        let first_layer = if untied { 2 } else { 1 };
        let make = |i: usize| -> Result<HostPart, BackendError> {
            Ok(match i {
                0 => HostPart::Mat(host_mat(weights, "token_embd.weight", ef, d.vocab, hd)?),
                1 if untied => HostPart::Mat(host_mat(weights, "output.weight", ef, d.vocab, hd)?),
                _ => HostPart::Layer(Box::new(HostLayer::read(
                    weights,
                    d,
                    wf,
                    (config.family.features(), moe),
                    i - first_layer,
                )?)),
            })
        };
        // four threads hold at most five items: for the bf16 8B, 2-3 GB of host memory (1 GB each
        // for the embedding and the head, 0.44 GB a layer)
        let workers = std::thread::available_parallelism().map_or(4, |n| n.get().min(4));
        let (mut emb, mut out) = (None, None);
        let mut layers = Vec::with_capacity(d.layers);
        crate::pipeline::ordered(
            first_layer + d.layers,
            workers,
            workers,
            &make,
            &mut |i, part| {
                match part {
                    HostPart::Mat(m) if i == 0 => emb = Some(DevMat::upload(dev, &m)?),
                    HostPart::Mat(m) => out = Some(DevMat::upload(dev, &m)?),
                    HostPart::Layer(l) => layers.push(l.upload(dev)?),
                }
                Ok(())
            },
        )?;
        let emb = emb.expect("item 0 is the embedding");
        let out_norm = dev.upload(&host_vec(weights, "output_norm.weight", hd)?)?;
        // RoPE scaling (llama3, linear, GGUF rope_freqs) lives in the table
        let inv_freq = crate::rope::model_inv_freq(config, positions, || {
            host_vec(weights, "rope_freqs.weight", d.head_dim / 2)
        })?;
        let rope = dev.upload(&crate::rope::rope_table(&inv_freq, positions))?;
        Ok(ModelWeights {
            emb,
            out,
            out_norm,
            rope,
            layers,
            moe,
        })
    }

    /// The LM head: `output.weight`, or the embedding when they are tied.
    pub fn head(&self) -> &DevMat {
        self.out.as_ref().unwrap_or(&self.emb)
    }

    /// Bytes one single-sequence decode step reads: every weight once, but of an embedding table
    /// separate from the LM head only the token's row, and of a layer's routed experts only the
    /// `used` a token goes to (the active parameters).
    pub fn decode_bytes(&self) -> u64 {
        let mut unread = match &self.out {
            Some(_) => self.emb.bytes() - self.emb.bytes() / self.emb.rows.max(1),
            None => 0,
        };
        if let Some(m) = self.moe {
            for l in &self.layers {
                unread += (l.wgu.bytes() + l.wdown.bytes()) / m.experts * (m.experts - m.used);
                // the router is read in one of its two layouts
                unread += l.router_cols.as_ref().map_or(0, |b| b.bytes);
            }
        }
        self.bytes() - unread as u64
    }

    /// Bytes of weights on the device (the RoPE table not counted).
    pub fn bytes(&self) -> u64 {
        let mut n =
            self.emb.bytes() + self.out.as_ref().map_or(0, DevMat::bytes) + self.out_norm.bytes;
        for l in &self.layers {
            n += l.attn_norm.bytes
                + l.qk_norm.as_ref().map_or(0, |b| b.bytes)
                + l.qkv_bias.as_ref().map_or(0, |b| b.bytes)
                + l.router.as_ref().map_or(0, |b| b.bytes)
                + l.router_cols.as_ref().map_or(0, |b| b.bytes)
                + l.wqkv.bytes()
                + l.wo.bytes()
                + l.ffn_norm.bytes
                + l.wgu.bytes()
                + l.wdown.bytes();
        }
        n as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `moe_out_route`'s router columns: a logit summed from them over the rows equals the
    /// router row's dot product with the normed input (up to the norm's scale), and each column
    /// is the router's transposed, times the norm weight of its row.
    #[test]
    fn router_columns_transpose_and_scale() {
        let (experts, hidden) = (3, 4);
        let router: Vec<f32> = (0..experts * hidden).map(|i| i as f32 - 5.0).collect();
        let norm = [0.5f32, 2.0, -1.0, 3.0];
        let cols = router_columns(&router, &norm);
        assert_eq!(cols.len(), experts * hidden);
        for e in 0..experts {
            for r in 0..hidden {
                assert_eq!(cols[r * experts + e], router[e * hidden + r] * norm[r]);
            }
        }
        let x = [1.0f32, -2.0, 0.25, 4.0];
        for e in 0..experts {
            let fused: f32 = (0..hidden).map(|r| cols[r * experts + e] * x[r]).sum();
            let plain: f32 = (0..hidden)
                .map(|r| router[e * hidden + r] * (x[r] * norm[r]))
                .sum();
            assert!((fused - plain).abs() <= 1e-5 * plain.abs().max(1.0));
        }
    }

    fn lcg(seed: &mut u64) -> u8 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u8
    }

    /// Random GGUF blocks of a quantized type with sane scales.
    pub(crate) fn random_blocks(dtype: DType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut out = Vec::new();
        for _ in 0..rows * (k / QK) {
            let d = half::f16::from_f32(0.002 + (lcg(&mut s) as f32) * 1e-4);
            match dtype {
                DType::Q4_1 => {
                    let m = half::f16::from_f32(-0.1 + (lcg(&mut s) as f32) * 1e-4);
                    out.extend_from_slice(&d.to_le_bytes());
                    out.extend_from_slice(&m.to_le_bytes());
                    for _ in 0..16 {
                        out.push(lcg(&mut s));
                    }
                }
                DType::Q8_0 => {
                    out.extend_from_slice(&d.to_le_bytes());
                    for _ in 0..32 {
                        out.push(lcg(&mut s));
                    }
                }
                _ => unreachable!(),
            }
        }
        out
    }

    #[test]
    fn repack_is_exact_against_core_dequant() {
        for (dtype, fmt) in [
            (DType::Q4_1, DevFormat::Q4_1),
            (DType::Q8_0, DevFormat::Q8_0),
            (DType::Q4_1, DevFormat::Bf16),
        ] {
            let (rows, k) = (5, 96);
            let data = random_blocks(dtype, rows, k, 7);
            let m = HostMat::repack("t", fmt, dtype, rows, k, &data).unwrap();
            assert_eq!(m.qs.len(), rows * m.qs_row());
            assert_eq!(m.sc.len(), rows * m.sc_row());
            let rb = dtype.row_bytes(k).unwrap();
            for r in 0..rows {
                let mut want = vec![0f32; k];
                dequantize_row(dtype, &data[r * rb..(r + 1) * rb], &mut want).unwrap();
                let got = m.dequant_row(r);
                for (g, w) in got.iter().zip(&want) {
                    let tol = if fmt == DevFormat::Bf16 {
                        w.abs() / 128.0
                    } else {
                        0.0
                    };
                    assert!((g - w).abs() <= tol, "{fmt:?} row {r}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn fp8_matrices_keep_their_bytes_and_row_scales() {
        let v: Vec<f32> = (0..3 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 700.0)
            .collect();
        let q = metrale_core::fp8::quantize_matrix(&v, 3, 64);
        let m = HostMat::fp8("x", 3, 64, &q.bytes, &q.scales).unwrap();
        assert_eq!((m.qs_row(), m.sc_row()), (64, 4));
        for r in 0..3 {
            let want: Vec<f32> = q.bytes[r * 64..(r + 1) * 64]
                .iter()
                .map(|&b| metrale_core::fp8::e4m3_to_f32(b) * q.scales[r])
                .collect();
            assert_eq!(m.dequant_row(r), want);
        }
        // gate/up interleaving carries each row's scale with its row
        let g = HostMat::interleave_rows("gu", &m, &m).unwrap();
        assert_eq!(g.dequant_row(3), m.dequant_row(1));
        // wrong sizes are refused by what is wrong; repack never takes fp8 (its scales are apart)
        assert!(matches!(
            HostMat::fp8("x", 3, 64, &q.bytes, &q.scales[..2]),
            Err(RepackError::Shape {
                what: "scales (one a row)",
                ..
            })
        ));
        assert!(matches!(
            HostMat::repack("x", DevFormat::Fp8, DType::F8_E4M3, 3, 64, &q.bytes),
            Err(RepackError::WrongDtype { .. })
        ));
    }

    #[test]
    fn repack_refuses_wrong_dtype_and_sizes() {
        let data = random_blocks(DType::Q8_0, 2, 64, 1);
        assert!(matches!(
            HostMat::repack("x", DevFormat::Q4_1, DType::Q8_0, 2, 64, &data),
            Err(RepackError::WrongDtype { .. })
        ));
        assert!(matches!(
            HostMat::repack("x", DevFormat::Q8_0, DType::Q8_0, 3, 64, &data),
            Err(RepackError::Shape { .. })
        ));
        assert!(matches!(
            HostMat::repack("x", DevFormat::Q8_0, DType::Q8_0, 2, 48, &data),
            Err(RepackError::Shape { .. })
        ));
    }

    #[test]
    fn interleave_and_concat_keep_rows() {
        let a = HostMat::repack(
            "a",
            DevFormat::Q4_1,
            DType::Q4_1,
            3,
            64,
            &random_blocks(DType::Q4_1, 3, 64, 1),
        )
        .unwrap();
        let b = HostMat::repack(
            "b",
            DevFormat::Q4_1,
            DType::Q4_1,
            3,
            64,
            &random_blocks(DType::Q4_1, 3, 64, 2),
        )
        .unwrap();
        let i = HostMat::interleave_rows("gu", &a, &b).unwrap();
        assert_eq!(i.rows, 6);
        for r in 0..3 {
            assert_eq!(i.dequant_row(2 * r), a.dequant_row(r));
            assert_eq!(i.dequant_row(2 * r + 1), b.dequant_row(r));
        }
        let c = HostMat::concat_rows("ab", &[a.clone(), b.clone()]).unwrap();
        assert_eq!(c.rows, 6);
        assert_eq!(c.dequant_row(4), b.dequant_row(1));
    }

    #[test]
    fn q4_1_panels_put_each_block_where_the_kernels_read_it() {
        // k = 384: 12 blocks a row, panels of Q41_PANEL (4) blocks; k = 96: 3 blocks, row-major
        for (rows, k) in [(5, 384), (3, 96)] {
            let m = HostMat::repack(
                "p",
                DevFormat::Q4_1,
                DType::Q4_1,
                rows,
                k,
                &random_blocks(DType::Q4_1, rows, k, 3),
            )
            .unwrap();
            let (qs, sc) = m.panelled();
            assert_eq!((qs.len(), sc.len()), (m.qs.len(), m.sc.len()));
            let nb = k / QK;
            let p = metrale_abi::layout::q41_panel(k);
            assert_eq!(p, if k == 384 { 4 } else { nb });
            for r in 0..rows {
                for b in 0..nb {
                    let at = (b / p) * rows * p + r * p + b % p; // common.cuh: WQ41::at
                    let row_major = r * nb + b;
                    assert_eq!(
                        qs[16 * at..16 * at + 16],
                        m.qs[16 * row_major..16 * row_major + 16]
                    );
                    assert_eq!(
                        sc[4 * at..4 * at + 4],
                        m.sc[4 * row_major..4 * row_major + 4]
                    );
                }
            }
        }
    }

    #[test]
    fn config_mismatch_names_the_field() {
        let d = Dims {
            layers: 30,
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
        };
        let mut c = ModelConfig {
            family: metrale_model::Family::Llama,
            name: "m".into(),
            arch: "llama".into(),
            model_type: "llama".into(),
            n_layers: 30,
            hidden: 576,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
            rope_theta: 100000.0,
            norm_eps: 1e-5,
            max_context: 8192,
            tied_embeddings: true,
            moe: None,
            rope_scaling: None,
            sliding: None,
            attn_scale: 1.0 / (64f32).sqrt(),
            bos: Some(1),
            eos: vec![2],
            add_bos: false,
            pooling: None,
            fp8: None,
            rotary_dim: 64,
        };
        // check_config of `c` against kernels of `family` (routed experts `moe`) built as
        // `target` with `wf` layer matrices, its error as text
        let check =
            |c: &ModelConfig, family: &str, moe: Option<MoeShape>, target: &str, wf: DevFormat| {
                check_config(c, &d, (family, moe), (target, wf)).map_err(|e| e.to_string())
            };
        let smol = "h200/smollm2-135m/q4_1";
        assert!(check(&c, "llama", None, smol, DevFormat::Q4_1).is_ok());
        c.hidden = 2048;
        let e = check(&c, "llama", None, smol, DevFormat::Q4_1).unwrap_err();
        assert!(
            e.contains("hidden is 2048") && e.contains("compiled for 576"),
            "{e}"
        );
        // RoPE scaling is no longer refused (the table carries it)
        c.hidden = 576;
        c.rope_scaling = Some(metrale_model::RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        });
        assert!(check(&c, "llama", None, "h200/llama-3.2-1b/q4_1", DevFormat::Q4_1).is_ok());
        // sliding windows (Mistral 7B v0.1) have no kernels: refused by name
        c.sliding = Some(metrale_model::config::Sliding::pattern(
            4096, 1, c.n_layers, 1e4,
        ));
        let e = check(&c, "llama", None, smol, DevFormat::Q4_1).unwrap_err();
        assert!(
            e.contains("sliding-window") && e.contains("cpu backend"),
            "{e}"
        );
        c.sliding = None;
        // a family other than the kernels' is refused by name, shape or not
        c.family = metrale_model::Family::Qwen3;
        let e = check(&c, "llama", None, smol, DevFormat::Q4_1).unwrap_err();
        assert!(
            e.contains("qwen3") && e.contains("compute the llama block"),
            "{e}"
        );
        let qwen = "h200/qwen3-tiny/bf16";
        assert!(check(&c, "qwen3", None, qwen, DevFormat::Bf16).is_ok());
        // FP8 checkpoints: on the fp8 kernels only, and with the activation scales they compute
        use metrale_core::fp8::Activations;
        c.fp8 = Some(Activations::Dynamic { ub: None });
        let t = "h200/qwen3-tiny/fp8";
        assert!(check(&c, "qwen3", None, t, DevFormat::Fp8).is_ok());
        let e = check(&c, "qwen3", None, qwen, DevFormat::Bf16).unwrap_err();
        assert!(
            e.contains("FP8 weights") && e.contains("--quant fp8"),
            "{e}"
        );
        for a in [
            Activations::Static,
            Activations::Dynamic { ub: Some(1200.0) },
        ] {
            c.fp8 = Some(a);
            let e = check(&c, "qwen3", None, t, DevFormat::Fp8).unwrap_err();
            assert!(e.contains(&a.to_string()) && e.contains("cpu"), "{e}");
        }
        c.fp8 = None;
        // routed experts: the compiled ones
        c.family = metrale_model::Family::Qwen3Moe;
        c.moe = Some(metrale_model::config::Moe {
            experts: 128,
            used: 8,
            ffn: 768,
            norm_topk: true,
        });
        let x = MoeShape {
            experts: 128,
            used: 8,
            ffn: 768,
        };
        c.ffn = 768; // the experts' width, as the readers give it; the target's is the dense one
        assert!(check(&c, "qwen3moe", Some(x), "h200/x/bf16", DevFormat::Bf16).is_ok());
        let four = Some(MoeShape { used: 4, ..x });
        let e = check(&c, "qwen3moe", four, "h200/x/bf16", DevFormat::Bf16).unwrap_err();
        assert!(
            e.contains("routed experts") && e.contains("compiled for"),
            "{e}"
        );
    }
}
