//! Host-side planning for the CUDA backend, pure and testable without a GPU: the attention split
//! count, launch grids, the per-kernel token tile, device-arch checks, and the repacking of GGUF
//! blocks into the device weight layouts of `kernels/cuda/common.cuh`.
//!
//! Invariants: every function here mirrors a constant or formula of the kernel sources and says
//! which; nothing here touches the driver.

use half::bf16;
use metrale_core::dtype::{dequantize_row, DType, QK};

/// Threads per block of the matrix-vector kernels (`mt::MV_THREADS` in common.cuh).
pub const MV_THREADS: u32 = 256;
/// Warps per block of the matrix-vector kernels: each warp owns one row pair at a time.
pub const MV_WARPS: u32 = MV_THREADS / 32;
/// Threads per block of `attention` (`ATT_THREADS` in attention.cu.hbs).
pub const ATT_THREADS: u32 = 256;
/// Threads per block of `embed`.
pub const EMBED_THREADS: u32 = 256;
/// Threads per block of `argmax_logprob` (`SAMPLE_THREADS` in sample.cu.hbs).
pub const SAMPLE_THREADS: u32 = 1024;
/// Most attention splits a launch may use (the partial buffers are sized for it).
pub const MAX_SPLITS: usize = 32;
/// Most attention splits the kernel can combine through one thread-block cluster (`MAX_CLUSTER` in
/// attention.cu.hbs; 8 is the portable cluster size): more splits use the global ticket combine.
pub const ATT_MAX_CLUSTER: usize = 8;
/// Most splits the backend launches as one cluster unless `METRALE_CUDA_CLUSTER` says otherwise:
/// measured on the H200 (bench/cuda/NOTES.md, v10), clusters of 2-4 blocks gain, 8 lose in the graph.
pub const ATT_CLUSTER_DEFAULT: usize = 4;
/// Fewest positions a split should cover before splitting further stops paying.
pub const MIN_SPLIT_LEN: usize = 32;

/// Number of sequence splits of the split-K attention for `ntok` query tokens whose longest sequence
/// is `seq_len`, with `kv_heads` KV heads (one block per KV head, split and token) on `sm_count` SMs.
///
/// Aims at about two blocks per SM, never gives a split fewer than [`MIN_SPLIT_LEN`] positions
/// (except the single split of a short sequence), is a power of two (so a decode loop captures few
/// CUDA graphs: the count changes only at doublings) and lies in `1..=MAX_SPLITS`.
pub fn attention_splits(seq_len: usize, kv_heads: usize, ntok: usize, sm_count: usize) -> usize {
    let blocks = kv_heads.max(1) * ntok.max(1);
    let fill = (2 * sm_count.max(1)).div_ceil(blocks);
    let by_len = seq_len.max(1).div_ceil(MIN_SPLIT_LEN);
    let want = fill.min(by_len).clamp(1, MAX_SPLITS);
    // round down to a power of two
    1usize << (usize::BITS - 1 - want.leading_zeros())
}

/// Tokens a matrix-vector block stages in shared memory for rows of `k` elements
/// (`mt::TokTile<K>::N` in common.cuh: 40 KiB of padded rows, between 1 and 8).
pub fn tok_tile(k: usize) -> usize {
    let bytes = (k / 32) * 36 * 4;
    (40960 / bytes.max(1)).clamp(1, 8)
}

/// Grid of a matrix-vector kernel over `row_pairs` row pairs and `ntok` tokens of row length `k`:
/// enough blocks for every warp to own one row pair, at most four blocks per SM (warps then loop).
pub fn mv_grid(row_pairs: usize, k: usize, ntok: usize, sm_count: usize) -> (u32, u32, u32) {
    let x = row_pairs
        .div_ceil(MV_WARPS as usize)
        .clamp(1, 4 * sm_count.max(1));
    let y = ntok.div_ceil(tok_tile(k)).max(1);
    (x as u32, y as u32, 1)
}

/// Blocks of `lm_head_1` (the one-output LM head) for a vocabulary of `vocab` rows: one wave, i.e.
/// `per_sm` resident blocks of `MV_THREADS` per SM (the driver's occupancy for the kernel), fewer
/// when each warp would get under 8 rows. Any count is correct (the warps stride over row
/// batches); this only sets the work per warp and the number of partials to merge.
pub fn lm_head1_blocks(vocab: usize, sm_count: usize, per_sm: usize) -> u32 {
    (per_sm.max(1) * sm_count.max(1))
        .min(vocab.div_ceil(8 * MV_WARPS as usize))
        .max(1) as u32
}

/// The compute capability a cubin arch such as "sm_90a" or "sm_80" runs on: (9, 0), (8, 0).
pub fn arch_capability(arch: &str) -> Option<(i32, i32)> {
    let digits: String = arch
        .strip_prefix("sm_")?
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    let n: i32 = digits.parse().ok()?;
    if n < 10 {
        return None;
    }
    Some((n / 10, n % 10))
}

/// The RoPE table the `attn_in` kernel reads: `(cos, sin)` of `pos * inv_freq[i]` for
/// `pos < n_pos`, `i < inv_freq.len()`, row-major by position: the CPU backend's
/// `cpu::ops::rope_factors`, so both backends rotate by identical factors.
pub fn rope_table(inv_freq: &[f32], n_pos: usize) -> Vec<[f32; 2]> {
    (0..n_pos)
        .flat_map(|p| crate::cpu::ops::rope_factors(2 * inv_freq.len(), p, inv_freq))
        .map(|(c, s)| [c, s])
        .collect()
}

/// Refuse a device whose compute capability is not the one the cubins were built for, with the
/// message users see: "built for sm_90a (h200); device 0 is sm_80 (NVIDIA A100 ...)".
pub fn check_arch(
    arch: &str,
    target: &str,
    ordinal: usize,
    device_cc: (i32, i32),
    device_name: &str,
) -> Result<(), String> {
    let want = arch_capability(arch)
        .ok_or_else(|| format!("kernel set {target}: unknown cubin arch {arch:?}"))?;
    if device_cc != want {
        let hw = target.split('/').next().unwrap_or("?");
        return Err(format!(
            "built for {arch} ({hw}); device {ordinal} is sm_{}{} ({device_name}): build the target for this GPU (cargo xtask list-targets)",
            device_cc.0, device_cc.1
        ));
    }
    Ok(())
}

/// A weight matrix in a device layout, still on the host: `rows` rows of `k` elements; `qs` holds
/// `qs_row` bytes per row, `sc` holds `sc_row` bytes per row (empty for bf16).
#[derive(Debug, Clone, PartialEq)]
pub struct HostMat {
    pub format: DevFormat,
    pub rows: usize,
    pub k: usize,
    pub qs: Vec<u8>,
    pub sc: Vec<u8>,
}

/// Device weight formats (common.cuh: WQ41, WQ80, WBF16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevFormat {
    Q4_1,
    Q8_0,
    Bf16,
}

impl DevFormat {
    /// The format a quant's `weights` / `embedding` string names.
    pub fn from_quant_name(s: &str) -> Option<DevFormat> {
        match s {
            "q4_1" => Some(DevFormat::Q4_1),
            "q8_0" => Some(DevFormat::Q8_0),
            "bf16" => Some(DevFormat::Bf16),
            _ => None,
        }
    }
    fn qs_row(self, k: usize) -> usize {
        match self {
            DevFormat::Q4_1 => k / 2,
            DevFormat::Q8_0 => k,
            DevFormat::Bf16 => 2 * k,
        }
    }
    fn sc_row(self, k: usize) -> usize {
        match self {
            DevFormat::Q4_1 => (k / QK) * 4,
            DevFormat::Q8_0 => (k / QK) * 2,
            DevFormat::Bf16 => 0,
        }
    }
}

/// Why a tensor cannot be put in a device format.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RepackError {
    #[error("tensor {tensor}: the {format:?} device layout needs {expected} data, got {got}; build the target whose quant matches the checkpoint")]
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
        if k % QK != 0 {
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

    /// Dequantise row `r` from the device layout (tests: the inverse of `repack`).
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let nb = self.k / QK;
        let q = &self.qs[r * self.qs_row()..(r + 1) * self.qs_row()];
        let s = &self.sc[r * self.sc_row()..(r + 1) * self.sc_row()];
        let mut out = vec![0f32; self.k];
        match self.format {
            DevFormat::Q4_1 => {
                for b in 0..nb {
                    let d = half::f16::from_le_bytes([s[4 * b], s[4 * b + 1]]).to_f32();
                    let m = half::f16::from_le_bytes([s[4 * b + 2], s[4 * b + 3]]).to_f32();
                    for j in 0..16 {
                        let byte = q[16 * b + j];
                        out[32 * b + j] = (byte & 15) as f32 * d + m;
                        out[32 * b + j + 16] = (byte >> 4) as f32 * d + m;
                    }
                }
            }
            DevFormat::Q8_0 => {
                for b in 0..nb {
                    let d = half::f16::from_le_bytes([s[2 * b], s[2 * b + 1]]).to_f32();
                    for j in 0..32 {
                        out[32 * b + j] = (q[32 * b + j] as i8) as f32 * d;
                    }
                }
            }
            DevFormat::Bf16 => {
                for (o, c) in out.iter_mut().zip(q.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_powers_of_two_within_bounds() {
        for seq in [1usize, 2, 31, 32, 33, 64, 100, 1000, 8192, 1 << 20] {
            for kv in [1usize, 3, 8] {
                for ntok in [1usize, 2, 8, 64, 512] {
                    for sm in [108usize, 132, 142] {
                        let s = attention_splits(seq, kv, ntok, sm);
                        assert!(
                            s.is_power_of_two() && (1..=MAX_SPLITS).contains(&s),
                            "{seq} {kv} {ntok} {sm} -> {s}"
                        );
                        // no split shorter than MIN_SPLIT_LEN unless there is only one
                        assert!(
                            s == 1 || seq.div_ceil(s) >= MIN_SPLIT_LEN / 2,
                            "{seq} {kv} {ntok} {sm} -> {s}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn splits_grow_with_length_and_shrink_with_batch() {
        // SmolLM2 on an H200: 3 KV heads, 132 SMs
        assert_eq!(attention_splits(10, 3, 1, 132), 1);
        assert_eq!(attention_splits(64, 3, 1, 132), 2);
        assert_eq!(attention_splits(200, 3, 1, 132), 4);
        assert_eq!(attention_splits(4096, 3, 1, 132), 32);
        assert_eq!(attention_splits(4096, 3, 64, 132), 2);
        assert_eq!(attention_splits(4096, 3, 512, 132), 1);
        assert_eq!(attention_splits(4096, 3, 8, 132), 8);
        let mut last = 0;
        for seq in 1..5000 {
            let s = attention_splits(seq, 3, 1, 132);
            assert!(s >= last);
            last = s;
        }
    }

    #[test]
    fn tok_tile_matches_kernel_formula() {
        assert_eq!(tok_tile(576), 8);
        assert_eq!(tok_tile(1536), 5);
        assert_eq!(tok_tile(2048), 4);
        assert_eq!(tok_tile(8192), 1);
    }

    #[test]
    fn arch_mismatch_is_refused_with_both_archs() {
        assert!(check_arch("sm_90a", "h200/smollm2-135m/q4_1", 0, (9, 0), "NVIDIA H200").is_ok());
        let e = check_arch(
            "sm_90a",
            "h200/smollm2-135m/q4_1",
            0,
            (8, 0),
            "NVIDIA A100-SXM4-80GB",
        )
        .unwrap_err();
        assert!(
            e.starts_with("built for sm_90a (h200); device 0 is sm_80 (NVIDIA A100-SXM4-80GB)"),
            "{e}"
        );
        assert!(check_arch("sm_89", "l40s/x/y", 1, (9, 0), "H100")
            .unwrap_err()
            .contains("device 1 is sm_90"));
    }

    #[test]
    fn arch_parse() {
        assert_eq!(arch_capability("sm_90a"), Some((9, 0)));
        assert_eq!(arch_capability("sm_80"), Some((8, 0)));
        assert_eq!(arch_capability("sm_89"), Some((8, 9)));
        assert_eq!(arch_capability("compute_90"), None);
        assert_eq!(arch_capability("sm_"), None);
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
}
