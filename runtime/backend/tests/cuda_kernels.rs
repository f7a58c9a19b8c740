//! Each CUDA kernel against the CPU reference ops (`metrale_backend::cpu::ops`) on fresh random
//! inputs (the seed is printed), on a real GPU.
//!
//! Needs: a CUDA device, `METRALE_CUDA_KERNELS` = a folder holding `<kernel>.cubin` of one target, and
//! `METRALE_CUDA_TARGET` = that target ("h200/smollm2-135m/q4_1" by default); `METRALE_TARGETS` =
//! the targets/ folder (default: found upwards from the working directory). Without a GPU or without
//! the variable, every test prints why and passes.
//!
//! Tolerances: outputs that are pure dequantisation (embedding rows) must be bit-identical; every
//! reduction (matvec, norm, attention) is compared by ‖gpu − cpu‖₂ / ‖cpu‖₂ < 1e-4 (f32 accumulation
//! in a different order lands near 1e-6), plus every element finite and written (outputs are poisoned
//! with NaN first).
#![cfg(feature = "cuda")]

mod common;

use metrale_backend::cpu::ops;
use metrale_backend::cuda::abi;
use metrale_backend::cuda::plan;
use metrale_backend::cuda::weights::{DevFormat, DevMat, HostMat};
use metrale_backend::cuda::{device_count, DevBuf, Gpu};
use metrale_backend::rope::{rope_inplace, rope_inv_freq, rope_table};
use metrale_backend::{blocks_for, sampler, Dims, KvDtype, KV_BLOCK};
use metrale_core::dtype::{bf16_to_f32, dequantize_row, f32_to_bf16, DType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Relative L2 error of a kernel against the CPU's f32 reference. f32 kernels differ by summation
/// order (~1e-6). Targets with `[quant] activations = "i16"` (h200/llama-3.1-8b/q4_1) quantize the
/// matrix-vector kernels' input rows to 16-bit blocks: half a step of 1/32767 of a block's largest
/// value per element, ~1.5e-5 relative on these uniform inputs; 1e-4 bounds both.
const TOL: f64 = 1e-4;
/// Targets with fp8 layer weights (`[quant] weights = "fp8"`) quantize each product's input row to
/// e4m3 per token, as the CPU reference does; targets with an fp8 KV cache quantize each head
/// vector they write with its own scale, the same way. Where the GPU's value differs from the
/// CPU's by f32 summation order (~1e-7 relative), a value within that distance of a rounding
/// midpoint rounds the other way, by one e4m3 step (2^-3 relative): ~1.6e-6 of the values, so a
/// few flips per test at most, each moving its token's outputs (or its head vector) by ~2^-3 /
/// sqrt(K) relative (~2e-3 at K = 4096, less over all tokens). Every check of such a target is
/// held to at least 5e-3; a missing input quantization (e4m3's ~3% relative error on every
/// value) or a missing row scale lands far above.
const FP8_TOL: f64 = 5e-3;
/// Whether this process tests a target with fp8 weights or an fp8 KV cache (set by [`env`]; one
/// target a process).
static FP8: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// K and V written to a bf16 cache, against the reference rounded the same way: an f32 difference
/// of ~1e-6 relative flips the rounding of the few values within it of a rounding boundary (each by
/// one bf16 step, 2^-8 relative), ~0.05% of them: ~1e-4 relative L2; bounded at 1e-3.
const KV_TOL: f64 = 1e-3;
/// The routed experts' matrix-vector kernels (`moe_gu` / `moe_down` and their grouped CUDA-core
/// forms) on q4_1 targets, whose i16 activations round both products' inputs: xn, then h =
/// SiLU(gate) * up, whose 32-element blocks have a largest value several times their rms (~1.7x
/// for the uniform inputs [`TOL`] is made for). Measured 8.6e-5 over 6 tokens and 2.0e-4 over 40
/// of which 37 are one row (its roundings do not average out), H200, h200/qwen3-30b-a3b/q4_1;
/// bounded at 5e-4. The tensor-core products (f16 hi + lo) are held to [`TOL`].
const MOE_A16_TOL: f64 = 5e-4;

struct Env {
    gpu: Gpu,
    d: Dims,
    wf: DevFormat,
    ef: DevFormat,
    eps: f32,
    theta: f32,
    kv: KvDtype,
    rng: StdRng,
    /// Targets whose family norms each Q/K head: the norm weights (q's then k's, `head_dim` each)
    /// on the host and the device.
    qkn: Option<(Vec<f32>, DevBuf)>,
    /// Targets whose family has Q/K/V biases: the biases (`[qd + 2 kd]`) on the host and the device.
    bias: Option<(Vec<f32>, DevBuf)>,
    /// The QKV products leave raw rows for `qkv_rope` (`features.qkv_rope`).
    raw_qkv: bool,
}

fn env(test: &str) -> Option<Env> {
    let Ok(dir) = std::env::var("METRALE_CUDA_KERNELS") else {
        eprintln!("{test}: skipped: METRALE_CUDA_KERNELS (a folder of <kernel>.cubin of one target) is unset");
        return None;
    };
    if device_count() == 0 {
        eprintln!("{test}: skipped: no CUDA device");
        return None;
    }
    let (target, spec, set) = common::target_kernels(&dir);
    let d = Dims::from_shape(&spec.model);
    let gpu = Gpu::open(0, &set).expect("open GPU and load kernels");
    let seed: u64 = std::env::var("METRALE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: target {target}, seed {seed} (set METRALE_TEST_SEED to replay)");
    let mut rng = StdRng::seed_from_u64(seed);
    let f = spec.features();
    assert_eq!(
        gpu.raw_qkv(),
        f.qkv_rope,
        "the target's kernels follow its features"
    );
    let mut on_both = |n: usize, lo: f32, hi: f32| {
        let w = rand_vec(&mut rng, n, lo, hi);
        let b = gpu.upload(&w).unwrap();
        (w, b)
    };
    let qkn = f.qk_norm.then(|| on_both(2 * d.head_dim, 0.5, 1.5));
    let wf = DevFormat::from_quant_name(&spec.quant.weights).unwrap();
    FP8.store(
        wf == DevFormat::Fp8 || spec.quant.kv_dtype() == KvDtype::Fp8,
        std::sync::atomic::Ordering::Relaxed,
    );
    let bias = f.qkv_bias.then(|| on_both(d.qd() + 2 * d.kd(), -0.5, 0.5));
    Some(Env {
        gpu,
        d,
        wf,
        ef: DevFormat::from_quant_name(&spec.quant.embedding).unwrap(),
        eps: spec.model.norm_eps as f32,
        theta: spec.model.rope_theta as f32,
        kv: spec.quant.kv_dtype(),
        rng,
        qkn,
        bias,
        raw_qkv: f.qkv_rope,
    })
}

/// A paged KV pool for the kernel tests: `slots` sequences of `ctx` positions whose blocks are
/// scattered over the pool (block i of slot s is pool block `blocks - 1 - (i * slots + s)`), so a
/// kernel that ignored its table would read and write the wrong rows. Values cross in the target's
/// KV type (bf16 rounded to nearest even, as the kernels store).
struct Paged {
    d: Dims,
    slots: usize,
    max_blocks: usize,
    tables: Vec<u32>,
    kv: KvDtype,
}

impl Paged {
    fn new(d: Dims, slots: usize, ctx: usize, kv: KvDtype) -> Paged {
        let max_blocks = blocks_for(ctx);
        let blocks = slots * max_blocks;
        let mut tables = vec![0u32; blocks];
        for s in 0..slots {
            for i in 0..max_blocks {
                tables[s * max_blocks + i] = (blocks - 1 - (i * slots + s)) as u32;
            }
        }
        Paged {
            d,
            slots,
            max_blocks,
            tables,
            kv,
        }
    }

    /// Elements of K (or V) in the pool.
    fn elems(&self) -> usize {
        self.slots * self.max_blocks * self.d.layers * self.d.kd() * KV_BLOCK
    }

    /// Element offset of (slot, layer, KV head h, position p): the kernels' `mt::kv_off`.
    fn off(&self, slot: usize, layer: usize, h: usize, p: usize) -> usize {
        let b = self.tables[slot * self.max_blocks + p / KV_BLOCK] as usize;
        (((b * self.d.layers + layer) * self.d.kv_heads + h) * KV_BLOCK + p % KV_BLOCK)
            * self.d.head_dim
    }

    /// A whole K (or V) pool of random values the cache holds exactly, so that a reference
    /// reading them reads what the kernels read: uniform in [-1, 1) (bf16 caches: rounded); for
    /// an fp8 cache, head vectors of random e4m3 bytes with one at +-448 and a power-of-two scale
    /// (2^-9), so that quantizing a vector again gives back its bytes and scale exactly.
    fn rand_cache(&self, rng: &mut StdRng) -> Vec<f32> {
        if self.kv == KvDtype::Fp8 {
            let hd = self.d.head_dim;
            let scale = 2f32.powi(-9);
            let mut v = vec![0f32; self.elems()];
            for vec in v.chunks_exact_mut(hd) {
                let top = rng.random_range(0..hd);
                for (i, x) in vec.iter_mut().enumerate() {
                    let b: u8 = if i == top {
                        if rng.random() {
                            0x7e
                        } else {
                            0xfe
                        }
                    } else {
                        // any finite code (0x7f and 0xff are NaN)
                        let b: u8 = rng.random();
                        if b & 0x7f == 0x7f {
                            b ^ 1
                        } else {
                            b
                        }
                    };
                    *x = metrale_core::fp8::e4m3_to_f32(b) * scale;
                }
            }
            return v;
        }
        rand_vec(rng, self.elems(), -1.0, 1.0)
            .into_iter()
            .map(|v| self.round(v))
            .collect()
    }

    /// `x` as an f32 or bf16 cache holds it (an fp8 one holds whole head vectors: `round_heads`).
    fn round(&self, x: f32) -> f32 {
        match self.kv {
            KvDtype::F32 => x,
            KvDtype::Bf16 => bf16_to_f32(f32_to_bf16(x)),
            KvDtype::Fp8 => unreachable!("an fp8 cache rounds whole head vectors (round_heads)"),
        }
    }

    /// `row` (head vectors of head_dim values one after another) as the cache holds it: an fp8
    /// cache each vector with its own scale, max|x| / 448, as the CPU's KvStore::Fp8 writes it.
    fn round_heads(&self, row: &[f32]) -> Vec<f32> {
        if self.kv != KvDtype::Fp8 {
            return row.iter().map(|&v| self.round(v)).collect();
        }
        let mut out = Vec::with_capacity(row.len());
        for vec in row.chunks_exact(self.d.head_dim) {
            let (bytes, s) = fp8_vector(vec);
            out.extend(bytes.iter().map(|&b| metrale_core::fp8::e4m3_to_f32(b) * s));
        }
        out
    }

    /// Bytes of one (block, layer, KV head) segment of an fp8 pool: its KV_BLOCK vectors, then
    /// their f32 scales (`mt::kv_seg`).
    fn fp8_seg(&self) -> usize {
        KV_BLOCK * (self.d.head_dim + 4)
    }

    fn upload(&self, g: &Gpu, vals: &[f32]) -> DevBuf {
        match self.kv {
            KvDtype::F32 => g.upload(vals).unwrap(),
            KvDtype::Bf16 => {
                let h: Vec<u16> = vals.iter().map(|&v| f32_to_bf16(v)).collect();
                g.upload(&h).unwrap()
            }
            KvDtype::Fp8 => {
                let hd = self.d.head_dim;
                let mut dev = Vec::with_capacity(vals.len() / (KV_BLOCK * hd) * self.fp8_seg());
                for seg in vals.chunks_exact(KV_BLOCK * hd) {
                    let mut scales = Vec::with_capacity(4 * KV_BLOCK);
                    for vec in seg.chunks_exact(hd) {
                        let (bytes, s) = fp8_vector(vec);
                        dev.extend_from_slice(&bytes);
                        scales.extend_from_slice(&s.to_le_bytes());
                    }
                    dev.extend_from_slice(&scales);
                }
                g.upload(&dev).unwrap()
            }
        }
    }

    fn read(&self, g: &Gpu, b: &DevBuf) -> Vec<f32> {
        let n = self.elems();
        match self.kv {
            KvDtype::F32 => read_f32(g, b, n),
            KvDtype::Bf16 => {
                let mut h = vec![0u16; n];
                g.read(b, 0, &mut h).unwrap();
                h.into_iter().map(bf16_to_f32).collect()
            }
            KvDtype::Fp8 => {
                let hd = self.d.head_dim;
                let mut dev = vec![0u8; n / (KV_BLOCK * hd) * self.fp8_seg()];
                g.read(b, 0, &mut dev).unwrap();
                let mut out = Vec::with_capacity(n);
                for seg in dev.chunks_exact(self.fp8_seg()) {
                    let (bytes, scales) = seg.split_at(KV_BLOCK * hd);
                    for (vec, s) in bytes.chunks_exact(hd).zip(scales.chunks_exact(4)) {
                        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                        out.extend(vec.iter().map(|&b| metrale_core::fp8::e4m3_to_f32(b) * s));
                    }
                }
                out
            }
        }
    }
}

/// One head vector as an fp8 cache writes it: e4m3 bytes of x / s and s = max|x| / 448 (1 for a
/// zero vector; `metrale_core::fp8`, as the CPU backend's KvStore::Fp8 and the kernels' qkv_rope).
fn fp8_vector(x: &[f32]) -> (Vec<u8>, f32) {
    use metrale_core::fp8::{f32_to_e4m3, row_scale};
    let s = row_scale(x.iter().fold(0f32, |m, v| m.max(v.abs())));
    (x.iter().map(|&v| f32_to_e4m3(v / s)).collect(), s)
}

fn dtype_of(f: DevFormat) -> DType {
    match f {
        DevFormat::Q4_1 => DType::Q4_1,
        DevFormat::Q8_0 => DType::Q8_0,
        DevFormat::Bf16 => DType::BF16,
        DevFormat::Fp8 => DType::F8_E4M3,
    }
}

/// Random GGUF-format bytes of `rows` x `k` in the dtype of `f`, with weights of order 0.05, and
/// for fp8 the rows' scales (`metrale_core::fp8::quantize_matrix` of uniform values; else empty).
fn rand_weights(rng: &mut StdRng, f: DevFormat, rows: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    if f == DevFormat::Fp8 {
        let v = rand_vec(rng, rows * k, -0.08, 0.08);
        let m = metrale_core::fp8::quantize_matrix(&v, rows, k);
        return (m.bytes, m.scales);
    }
    let mut out = Vec::new();
    let nb = k / 32;
    match f {
        DevFormat::Q4_1 => {
            for _ in 0..rows * nb {
                out.extend_from_slice(
                    &half::f16::from_f32(rng.random_range(0.002..0.012)).to_le_bytes(),
                );
                out.extend_from_slice(
                    &half::f16::from_f32(rng.random_range(-0.09..0.0)).to_le_bytes(),
                );
                for _ in 0..16 {
                    out.push(rng.random());
                }
            }
        }
        DevFormat::Q8_0 => {
            for _ in 0..rows * nb {
                out.extend_from_slice(
                    &half::f16::from_f32(rng.random_range(0.0002..0.0008)).to_le_bytes(),
                );
                for _ in 0..32 {
                    out.push(rng.random());
                }
            }
        }
        DevFormat::Bf16 => {
            for _ in 0..rows * k {
                out.extend_from_slice(
                    &half::bf16::from_f32(rng.random_range(-0.08..0.08)).to_le_bytes(),
                );
            }
        }
        DevFormat::Fp8 => unreachable!("returned above"),
    }
    (out, Vec::new())
}

fn rand_vec(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

struct Mat {
    dtype: DType,
    rows: usize,
    k: usize,
    data: Vec<u8>,
    /// An fp8 matrix's row scales (empty for the other types).
    scales: Vec<f32>,
}

impl Mat {
    fn new(rng: &mut StdRng, f: DevFormat, rows: usize, k: usize) -> Mat {
        let (data, scales) = rand_weights(rng, f, rows, k);
        Mat {
            dtype: dtype_of(f),
            rows,
            k,
            data,
            scales,
        }
    }
    /// The CPU reference's view: an fp8 matrix's products quantize their input per token
    /// (dynamic scales, as the fp8 kernels do).
    fn cpu(&self) -> ops::MatRef<'_> {
        ops::MatRef {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.k,
            data: &self.data,
            packed: false,
            fp8: (self.dtype == DType::F8_E4M3).then_some(metrale_backend::cpu::mat::Fp8Ref {
                scales: &self.scales,
                input_scale: None,
                ub: None,
            }),
        }
    }
    fn host(&self, f: DevFormat) -> HostMat {
        if f == DevFormat::Fp8 {
            return HostMat::fp8("test", self.rows, self.k, &self.data, &self.scales).unwrap();
        }
        HostMat::repack("test", f, self.dtype, self.rows, self.k, &self.data).unwrap()
    }
    fn matvec(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; self.rows];
        ops::matvec(self.cpu(), x, &mut out);
        out
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (g, w) in got.iter().zip(want) {
        assert!(
            g.is_finite(),
            "non-finite output {g} (unwritten or overflow)"
        );
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    check_tol(what, got, want, TOL);
}

fn check_tol(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let tol = if FP8.load(std::sync::atomic::Ordering::Relaxed) {
        tol.max(FP8_TOL)
    } else {
        tol
    };
    let e = rel_err(got, want);
    eprintln!("  {what}: rel err {e:.2e} over {} values", got.len());
    assert!(e < tol, "{what}: relative error {e:.3e} >= {tol:e}");
}

/// The host reference of a QKV launch: inputs, norm weights, the three matrices, RoPE frequencies.
#[derive(Clone, Copy)]
struct QkvRef<'a> {
    x: &'a [f32],
    norm: &'a [f32],
    wq: &'a Mat,
    wk: &'a Mat,
    wv: &'a Mat,
    inv: &'a [f32],
    /// the family's per-head Q/K norm weights (q's then k's), where it has them
    qkn: Option<&'a [f32]>,
    /// the family's Q/K/V biases (`[qd + 2 kd]`), where it has them
    bias: Option<&'a [f32]>,
}

/// The columns a QKV launch writes per token into its `q`: the queries, or where the target's
/// family adds Q/K/V biases or norms each Q/K head the raw rows of all three products
/// (`qkv_rope`'s input).
fn q_cols(e: &Env) -> usize {
    match e.raw_qkv {
        true => e.d.qd() + 2 * e.d.kd(),
        false => e.d.qd(),
    }
}

/// The queries of a QKV launch over `n` tokens that wrote its `q` (`o.q`) into `raw`: read back,
/// or where the products leave raw rows, `qkv_rope` run first on them (writing a fresh q buffer
/// and `o`'s caches), the kernel the forward pass runs after the product.
fn qkv_finish(
    e: &Env,
    o: &metrale_backend::cuda::gemm::QkvOut,
    raw: &DevBuf,
    n: usize,
) -> Vec<f32> {
    let g = &e.gpu;
    if !e.raw_qkv {
        return read_f32(g, raw, n * e.d.qd());
    }
    let qb = poisoned(g, n * e.d.qd());
    let o = metrale_backend::cuda::gemm::QkvOut { q: qb.ptr, ..*o };
    let ptr = |v: &Option<(Vec<f32>, DevBuf)>| v.as_ref().map_or(0, |(_, b)| b.ptr);
    g.qkv_rope(o.qkv_rope(raw.ptr, (ptr(&e.bias), ptr(&e.qkn)), e.d.head_dim, n))
        .unwrap();
    read_f32(g, &qb, n * e.d.qd())
}

/// Check a QKV launch (RMSNorm + products + RoPE on q and k + K/V cache write) of the tokens at
/// `(pos, slot)` of `layer` against `r`: q as returned, each token's K and V rows read from the
/// paged caches through their tables (the reference rounded as the cache rounds: bf16 caches are
/// compared within `KV_TOL`), and nothing else in the K cache written (it was filled with 1e30).
/// `what` prefixes the check names; `tol`, where given, bounds q, K and V alike.
fn check_qkv(
    what: &str,
    d: Dims,
    eps: f32,
    r: QkvRef<'_>,
    (pos, slot, layer, pg): (&[i32], &[i32], usize, &Paged),
    (q, kcache, vcache): (&[f32], &[f32], &[f32]),
    tol: Option<f64>,
) {
    // `tol` replaces both bounds where given (the Hopper GEMM path's bf16 activations)
    let (q_tol, kv_tol) = tol.map_or(
        (
            TOL,
            match pg.kv {
                KvDtype::F32 => TOL,
                KvDtype::Bf16 | KvDtype::Fp8 => KV_TOL,
            },
        ),
        |t| (t, t),
    );
    let hd = d.head_dim;
    let (mut wq_all, mut wk_all, mut wv_all, mut gk, mut gv) =
        (vec![], vec![], vec![], vec![], vec![]);
    for t in 0..pos.len() {
        let mut xn = vec![0f32; d.hidden];
        ops::rmsnorm(&r.x[t * d.hidden..(t + 1) * d.hidden], r.norm, eps, &mut xn);
        let (mut qr, mut kr, mut vr) = (r.wq.matvec(&xn), r.wk.matvec(&xn), r.wv.matvec(&xn));
        if let Some(b) = r.bias {
            let (bq, bk) = b.split_at(d.qd());
            let (bk, bv) = bk.split_at(d.kd());
            for (rows, b) in [(&mut qr, bq), (&mut kr, bk), (&mut vr, bv)] {
                ops::add_inplace(rows, b);
            }
        }
        if let Some(w) = r.qkn {
            for (rows, w) in [(&mut qr, &w[..hd]), (&mut kr, &w[hd..])] {
                for h in rows.chunks_exact_mut(hd) {
                    let raw = h.to_vec();
                    ops::rmsnorm(&raw, w, eps, h);
                }
            }
        }
        rope_inplace(&mut qr, hd, pos[t] as usize, r.inv);
        rope_inplace(&mut kr, hd, pos[t] as usize, r.inv);
        wq_all.extend(qr);
        wk_all.extend(pg.round_heads(&kr));
        wv_all.extend(pg.round_heads(&vr));
        for h in 0..d.kv_heads {
            let off = pg.off(slot[t] as usize, layer, h, pos[t] as usize);
            gk.extend_from_slice(&kcache[off..off + hd]);
            gv.extend_from_slice(&vcache[off..off + hd]);
        }
    }
    check_tol(&format!("{what}q (norm+proj+rope)"), q, &wq_all, q_tol);
    let kv_check = |what: &str, got: &[f32], want: &[f32]| check_tol(what, got, want, kv_tol);
    kv_check(&format!("{what}k cache (norm+proj+rope)"), &gk, &wk_all);
    kv_check(&format!("{what}v cache (norm+proj)"), &gv, &wv_all);
    let sentinel = pg.round_heads(&vec![1e30; d.head_dim])[0];
    assert_eq!(
        kcache.iter().filter(|v| **v != sentinel).count(),
        pos.len() * d.kd(),
        "K cache entries written outside the tokens' positions"
    );
}

/// The expert histogram a kernel counted into `b` (`experts` u32).
fn read_counts(g: &Gpu, b: &DevBuf, experts: usize) -> Vec<u32> {
    let mut v = vec![0u32; experts];
    g.read(b, 0, &mut v).unwrap();
    v
}

/// The histogram of `ids` over `experts`, each choice counted `each` times (launches).
fn histogram(ids: &[i32], experts: usize, each: u32) -> Vec<u32> {
    let mut h = vec![0u32; experts];
    for &e in ids {
        h[e as usize] += each;
    }
    h
}

fn read_f32(g: &Gpu, b: &DevBuf, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    g.read(b, 0, &mut v).unwrap();
    v
}

fn poisoned(g: &Gpu, n: usize) -> DevBuf {
    g.upload(&vec![f32::NAN; n]).unwrap()
}

/// The first `n` values of an activation the GEMM path hands to a product (`ActType`: the
/// attention output, the FFN activation `h`), widened to f32.
fn read_act(g: &Gpu, b: &DevBuf, n: usize, ty: metrale_backend::cuda::gemm::ActType) -> Vec<f32> {
    use metrale_backend::cuda::gemm::ActType;
    if ty == ActType::F32 {
        return read_f32(g, b, n);
    }
    let mut v = vec![0u16; n];
    g.read(b, 0, &mut v).unwrap();
    v.into_iter().map(|u| act_f32(u, ty)).collect()
}

/// A 16-bit `ActType` value's bits, widened to f32.
fn act_f32(bits: u16, ty: metrale_backend::cuda::gemm::ActType) -> f32 {
    match ty {
        metrale_backend::cuda::gemm::ActType::Bf16 => half::bf16::from_bits(bits).to_f32(),
        _ => half::f16::from_bits(bits).to_f32(),
    }
}

/// `v` rounded to nearest in a 16-bit `ActType`, as the kernels round it (f16 saturating at
/// +-65504), as bits.
fn act_bits(v: f32, ty: metrale_backend::cuda::gemm::ActType) -> u16 {
    use metrale_backend::cuda::gemm::ActType;
    match ty {
        ActType::Bf16 => half::bf16::from_f32(v).to_bits(),
        ActType::F16 => half::f16::from_f32(v.clamp(-65504.0, 65504.0)).to_bits(),
        ActType::F32 => panic!("f32 has no 16-bit form"),
    }
}

/// An activation in the GEMM path's hand-over type (`ActType`), rounded as the kernels round it.
fn upload_act(g: &Gpu, h: &[f32], ty: metrale_backend::cuda::gemm::ActType) -> DevBuf {
    if ty == metrale_backend::cuda::gemm::ActType::F32 {
        return g.upload(h).unwrap();
    }
    let bits: Vec<u16> = h.iter().map(|&v| act_bits(v, ty)).collect();
    g.upload(&bits).unwrap()
}

#[test]
fn embed_rows_are_exact() {
    let Some(mut e) = env("embed") else { return };
    let d = e.d;
    let table = Mat::new(&mut e.rng, e.ef, d.vocab, d.hidden);
    let dm = DevMat::upload(&e.gpu, &table.host(e.ef)).unwrap();
    let toks: Vec<i32> = (0..7)
        .map(|_| e.rng.random_range(0..d.vocab as i32))
        .chain([0, d.vocab as i32 - 1])
        .collect();
    let tb = e.gpu.upload(&toks).unwrap();
    let x = poisoned(&e.gpu, toks.len() * d.hidden);
    e.gpu
        .embed(abi::Embed {
            qs: dm.qs.ptr,
            sc: dm.sc_ptr(),
            tokens: tb.ptr,
            x: x.ptr,
            ntok: toks.len() as i32,
        })
        .unwrap();
    let got = read_f32(&e.gpu, &x, toks.len() * d.hidden);
    let rb = table.dtype.row_bytes(d.hidden).unwrap();
    for (i, &t) in toks.iter().enumerate() {
        let mut want = vec![0f32; d.hidden];
        dequantize_row(
            table.dtype,
            &table.data[t as usize * rb..(t as usize + 1) * rb],
            &mut want,
        )
        .unwrap();
        assert_eq!(
            &got[i * d.hidden..(i + 1) * d.hidden],
            &want[..],
            "token {t}"
        );
    }
}

#[test]
fn attn_in_norm_qkv_rope_and_kv_write() {
    let Some(mut e) = env("attn_in") else { return };
    let d = e.d;
    let (qd, kd, hd) = (d.qd(), d.kd(), d.head_dim);
    let slots = 2;
    let ctx = 40;
    let layer = d.layers - 1;
    // 11 tokens: more than one token tile; two slots, scattered positions
    let pos: Vec<i32> = vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 39, 17];
    let slot: Vec<i32> = vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1];
    let n = pos.len();
    let x = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
    let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
    let wq = Mat::new(&mut e.rng, e.wf, qd, d.hidden);
    let wk = Mat::new(&mut e.rng, e.wf, kd, d.hidden);
    let wv = Mat::new(&mut e.rng, e.wf, kd, d.hidden);
    let wqkv = HostMat::concat_rows("qkv", &[wq.host(e.wf), wk.host(e.wf), wv.host(e.wf)]).unwrap();
    let g = &e.gpu;
    let (xb, nb, wb) = (
        g.upload(&x).unwrap(),
        g.upload(&norm).unwrap(),
        DevMat::upload(g, &wqkv).unwrap(),
    );
    let qb = poisoned(g, n * q_cols(&e));
    let pg = Paged::new(d, slots, ctx, e.kv);
    let kc = pg.upload(g, &vec![1e30f32; pg.elems()]);
    let vc = pg.upload(g, &vec![1e30f32; pg.elems()]);
    let tb = g.upload(&pg.tables).unwrap();
    let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
    let inv = rope_inv_freq(hd, e.theta, None, None);
    let rope = g.upload(&rope_table(&inv, ctx)).unwrap();
    let o = metrale_backend::cuda::gemm::QkvOut {
        rope: rope.ptr,
        q: qb.ptr,
        kc: kc.ptr,
        vc: vc.ptr,
        pos: pb.ptr,
        slot: sb.ptr,
        tables: tb.ptr,
        layer: layer as i32,
        max_blocks: pg.max_blocks as i32,
    };
    g.attn_in(o.attn_in(xb.ptr, nb.ptr, &wb, n)).unwrap();
    let q = qkv_finish(&e, &o, &qb, n);
    let kcache = pg.read(g, &kc);
    let vcache = pg.read(g, &vc);
    check_qkv(
        "",
        d,
        e.eps,
        QkvRef {
            x: &x,
            norm: &norm,
            wq: &wq,
            wk: &wk,
            wv: &wv,
            inv: &inv,
            qkn: e.qkn.as_ref().map(|(w, _)| &w[..]),
            bias: e.bias.as_ref().map(|(b, _)| &b[..]),
        },
        (&pos, &slot, layer, &pg),
        (&q, &kcache, &vcache),
        None,
    );

    // One token's attn_in and qkv_rope as one launch (attn_in_head, where the target has it):
    // the CPU reference's values within the same bounds, and the two launches' values within
    // 1e-5 (the same products and adds, the head's squares summed in qkv_rope's order: only a
    // compiler's fused multiply-adds may differ, ~1e-7)
    if g.qkv_head_fused(1) {
        let t = n - 1;
        let (q1, kc1, vc1) = (
            poisoned(g, qd),
            pg.upload(g, &vec![1e30f32; pg.elems()]),
            pg.upload(g, &vec![1e30f32; pg.elems()]),
        );
        let (p1, s1) = (g.upload(&pos[t..]).unwrap(), g.upload(&slot[t..]).unwrap());
        let xt = &x[t * d.hidden..(t + 1) * d.hidden];
        let xtb = g.upload(xt).unwrap();
        let ptr = |v: &Option<(Vec<f32>, DevBuf)>| v.as_ref().map_or(0, |(_, b)| b.ptr);
        let o1 = metrale_backend::cuda::gemm::QkvOut {
            q: q1.ptr,
            kc: kc1.ptr,
            vc: vc1.ptr,
            pos: p1.ptr,
            slot: s1.ptr,
            ..o
        };
        g.attn_in_head(o1.attn_in_head(xtb.ptr, nb.ptr, &wb, (ptr(&e.bias), ptr(&e.qkn)), hd))
            .unwrap();
        let q1v = read_f32(g, &q1, qd);
        let (kc1v, vc1v) = (pg.read(g, &kc1), pg.read(g, &vc1));
        check_qkv(
            "attn_in_head: ",
            d,
            e.eps,
            QkvRef {
                x: xt,
                norm: &norm,
                wq: &wq,
                wk: &wk,
                wv: &wv,
                inv: &inv,
                qkn: e.qkn.as_ref().map(|(w, _)| &w[..]),
                bias: e.bias.as_ref().map(|(b, _)| &b[..]),
            },
            (&pos[t..], &slot[t..], layer, &pg),
            (&q1v, &kc1v, &vc1v),
            None,
        );
        check_tol(
            "attn_in_head: q against attn_in + qkv_rope",
            &q1v,
            &q[t * qd..(t + 1) * qd],
            1e-5,
        );
        let (mut got, mut want) = (vec![], vec![]);
        for h in 0..d.kv_heads {
            let off = pg.off(slot[t] as usize, layer, h, pos[t] as usize);
            for (a, b) in [(&kc1v, &kcache), (&vc1v, &vcache)] {
                got.extend_from_slice(&a[off..off + hd]);
                want.extend_from_slice(&b[off..off + hd]);
            }
        }
        // a 16-bit cache may round a value ~1e-7 apart the other way: one step, 2^-8 of it
        let kv_tol = match pg.kv {
            KvDtype::F32 => 1e-5,
            KvDtype::Bf16 | KvDtype::Fp8 => 4e-3,
        };
        check_tol(
            "attn_in_head: K and V against attn_in + qkv_rope",
            &got,
            &want,
            kv_tol,
        );
    }
}

/// The CPU reference of attention for tokens at `(pos, slot)` of `layer`: each token's K and V rows
/// gathered from the paged caches through their tables, then `ops::attention` over 0..=pos.
fn attention_ref(
    pg: &Paged,
    (kc, vc): (&[f32], &[f32]),
    q: &[f32],
    (pos, slot): (&[i32], &[i32]),
    layer: usize,
) -> Vec<f32> {
    let d = pg.d;
    let (qd, hd, kvd) = (d.qd(), d.head_dim, d.kd());
    let scale = 1.0 / (hd as f32).sqrt();
    let mut want = Vec::with_capacity(pos.len() * qd);
    let mut scores = Vec::new();
    for t in 0..pos.len() {
        let len = pos[t] as usize + 1;
        let (mut k, mut v) = (vec![0f32; len * kvd], vec![0f32; len * kvd]);
        for p in 0..len {
            for h in 0..d.kv_heads {
                let off = pg.off(slot[t] as usize, layer, h, p);
                k[p * kvd + h * hd..][..hd].copy_from_slice(&kc[off..off + hd]);
                v[p * kvd + h * hd..][..hd].copy_from_slice(&vc[off..off + hd]);
            }
        }
        let mut att = vec![0f32; qd];
        ops::attention(
            &q[t * qd..(t + 1) * qd],
            &k,
            &v,
            len,
            d.heads,
            d.kv_heads,
            hd,
            scale,
            &mut scores,
            &mut att,
        );
        want.extend_from_slice(&att);
    }
    want
}

#[test]
fn attention_splits_combine_and_out_projection() {
    let Some(mut e) = env("attention") else {
        return;
    };
    let d = e.d;
    let (qd, hd) = (d.qd(), d.head_dim);
    let slots = 2;
    let ctx = 300;
    let layer = 1;
    let pos: Vec<i32> = vec![257, 7, 0];
    let slot: Vec<i32> = vec![0, 1, 1];
    let n = pos.len();
    let pg = Paged::new(d, slots, ctx, e.kv);
    let kc = pg.rand_cache(&mut e.rng);
    let vc = pg.rand_cache(&mut e.rng);
    let q = rand_vec(&mut e.rng, n * qd, -1.0, 1.0);
    let x = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
    let wo = Mat::new(&mut e.rng, e.wf, d.hidden, qd);
    // reference
    let want_att = attention_ref(&pg, (&kc, &vc), &q, (&pos, &slot), layer);
    let mut want_x = Vec::new();
    for t in 0..n {
        let o = wo.matvec(&want_att[t * qd..(t + 1) * qd]);
        want_x.extend(
            x[t * d.hidden..(t + 1) * d.hidden]
                .iter()
                .zip(&o)
                .map(|(a, b)| a + b),
        );
    }
    let g = &e.gpu;
    let (kb, vb, qb) = (pg.upload(g, &kc), pg.upload(g, &vc), g.upload(&q).unwrap());
    let tb = g.upload(&pg.tables).unwrap();
    let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
    let wb = DevMat::upload(g, &wo.host(e.wf)).unwrap();
    let ml = g.alloc(n * d.heads * plan::MAX_SPLITS * 8).unwrap();
    let acc = g.alloc(n * d.heads * plan::MAX_SPLITS * hd * 4).unwrap();
    let hb = abi::layout::att_head_blocks(d.group());
    let counter = g.alloc(n * d.kv_heads * hb * 4).unwrap();
    let auto = plan::attention_splits(258, d.kv_heads, n, g.sm_count);
    // on sm_90, 2..=attention_cluster splits (the target's HARDWARE.toml) run as one thread-block
    // cluster combined through distributed shared memory; more use the ticket combine. Each with
    // the scores summed by warp sums and by the transpose-reduce (flags).
    // One split also with 2, 4 and 8 (token, KV head) pairs a block where they divide the KV heads
    // (`plan::attention_pack`: 4, 2 and 1 warps a pair; one warp writes from its registers).
    let packs = (1..=3u32)
        .filter(|p| d.kv_heads % (1 << p) == 0)
        .map(|p| (1usize, (p << abi::ATT_PACK_SHIFT) as i32));
    let runs = [1usize, 2, 3, 4, 8, 32, auto]
        .into_iter()
        .map(|s| (s, 0))
        .chain(packs)
        .flat_map(|(s, pack)| [(s, pack), (s, pack | abi::ATT_FLAG_TRANSPOSE as i32)]);
    let args = |nsplit: usize, flags: i32, out: u64| abi::Attention {
        q: qb.ptr,
        kc: kb.ptr,
        vc: vb.ptr,
        pos: pb.ptr,
        slot: sb.ptr,
        tables: tb.ptr,
        layer: layer as i32,
        max_blocks: pg.max_blocks as i32,
        nsplit: nsplit as i32,
        flags,
        part_ml: ml.ptr,
        part_acc: acc.ptr,
        counter: counter.ptr,
        out,
    };
    for (nsplit, flags) in runs {
        let xb = g.upload(&x).unwrap();
        let att = poisoned(g, n * qd);
        let launch = || g.attention(args(nsplit, flags, att.ptr), n, false).unwrap();
        launch();
        check(
            &format!("attention, {nsplit} splits, flags {flags}"),
            &read_f32(g, &att, n * qd),
            &want_att,
        );
        // attention_hs (the group's query heads over several blocks), twice: its tickets re-armed
        if hb > 1 && (flags >> abi::ATT_PACK_SHIFT) & 3 == 0 {
            for round in 0..2 {
                let hs = poisoned(g, n * qd);
                g.attention(args(nsplit, flags, hs.ptr), n, true).unwrap();
                check(
                    &format!("attention_hs ({hb} blocks a KV head), {nsplit} splits, flags {flags}, launch {round}"),
                    &read_f32(g, &hs, n * qd),
                    &want_att,
                );
            }
        }
        // run twice: the second launch checks that the combine tickets were re-armed
        g.write(&att, 0, &vec![f32::NAN; n * qd]).unwrap();
        launch();
        g.attn_out(abi::AttnOut {
            att: att.ptr,
            wqs: wb.qs.ptr,
            wsc: wb.sc_ptr(),
            x: xb.ptr,
            ntok: n as i32,
        })
        .unwrap();
        let got = read_f32(g, &xb, n * d.hidden);
        check(
            &format!("x + Wo*attention, {nsplit} splits, flags {flags}"),
            &got,
            &want_x,
        );
        // the output in the Hopper O product's 16-bit activations: the f32 output, rounded
        let f32_out = read_f32(g, &att, n * qd);
        let (ty, out16) = (act_type(g), flags | abi::ATT_FLAG_OUT16 as i32);
        let att16 = g.alloc(n * qd * 2).unwrap();
        g.attention(
            abi::Attention {
                flags: out16,
                out: att16.ptr,
                ..args(nsplit, flags, att.ptr)
            },
            n,
            false,
        )
        .unwrap();
        assert_rounded(
            &format!("attention, {nsplit} splits, flags {out16}"),
            &read_act(g, &att16, n * qd, ty),
            &f32_out,
            ty,
        );
    }
}

/// The 16-bit type a target's attention output reaches the Hopper O product in.
fn act_type(g: &Gpu) -> metrale_backend::cuda::gemm::ActType {
    metrale_backend::cuda::gemm::ActType::hopper(g.weights_bf16())
}

/// `got` (16-bit values widened) is exactly `want` (f32) rounded to nearest in `ty`.
fn assert_rounded(what: &str, got: &[f32], want: &[f32], ty: metrale_backend::cuda::gemm::ActType) {
    use metrale_backend::cuda::gemm::ActType;
    let round = |v: f32| match ty {
        ActType::F32 => v,
        _ => act_f32(act_bits(v, ty), ty),
    };
    let bad = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != round(*b).to_bits());
    assert!(
        bad.is_none(),
        "{what}: element {} is {} where {} rounds to {}",
        bad.unwrap_or(0),
        got[bad.unwrap_or(0)],
        want[bad.unwrap_or(0)],
        round(want[bad.unwrap_or(0)])
    );
    eprintln!(
        "  {what}: {} values, each the f32 output rounded to {ty:?}",
        got.len()
    );
}

/// `attention_flash` against the CPU reference. q and the softmax weights enter the tensor cores
/// rounded to bf16 (2^-9 relative each, K and V are bf16 already); with scores of standard
/// deviation ~1 that lands near 2e-3 relative L2 (measured on the H200, 8B shape), bounded at 1e-2.
const FLASH_TOL: f64 = 1e-2;

#[test]
fn flash_attention_tiles_pages_and_earlier_chunks() {
    let Some(mut e) = env("attention_flash") else {
        return;
    };
    if !e.gpu.flash_attention {
        eprintln!("attention_flash: skipped: the target's KV cache is not bf16 (the kernel is empty there)");
        return;
    }
    let d = e.d;
    let qd = d.qd();
    let (slots, ctx, layer) = (3, 1200, 1);
    // slot 0 continues a prompt at 40 (its first 40 positions are an earlier chunk's), slot 1
    // starts one, slot 2 decodes one token deep in its context; tiles cut across page edges
    let mut pos: Vec<i32> = (40..141).collect();
    let mut slot = vec![0; pos.len()];
    pos.extend(0..71);
    slot.extend(vec![1; 71]);
    pos.push(1100);
    slot.push(2);
    let n = pos.len();
    let pg = Paged::new(d, slots, ctx, e.kv);
    let kc = pg.rand_cache(&mut e.rng);
    let vc = pg.rand_cache(&mut e.rng);
    // scores of standard deviation ~1 (peaked softmax rows, not uniform ones)
    let q = rand_vec(&mut e.rng, n * qd, -3.0, 3.0);
    let want = attention_ref(&pg, (&kc, &vc), &q, (&pos, &slot), layer);
    let g = &e.gpu;
    let (kb, vb, qb) = (pg.upload(g, &kc), pg.upload(g, &vc), g.upload(&q).unwrap());
    let tb = g.upload(&pg.tables).unwrap();
    let (pb, sb) = (g.upload(&pos).unwrap(), g.upload(&slot).unwrap());
    let tiles = plan::flash_tiles(&pos, &slot, abi::layout::flash_tokens(d.heads / d.kv_heads));
    let tiles_b = g.upload(&tiles).unwrap();
    let launch = |flags: i32, out: u64| {
        let a = abi::AttentionFlash {
            q: qb.ptr,
            kc: kb.ptr,
            vc: vb.ptr,
            pos: pb.ptr,
            slot: sb.ptr,
            tables: tb.ptr,
            layer: layer as i32,
            max_blocks: pg.max_blocks as i32,
            tiles: tiles_b.ptr,
            flags,
            out,
        };
        g.attention_flash(a, tiles.len() / 2).unwrap();
    };
    let run = || {
        let att = poisoned(g, n * qd);
        launch(0, att.ptr);
        read_f32(g, &att, n * qd)
    };
    let got = run();
    check_tol("attention_flash", &got, &want, FLASH_TOL);
    // each token's rows alone too: the single decode token and a tile edge
    for t in [0usize, 15, 16, 100, 101, n - 1] {
        check_tol(
            &format!("attention_flash token {t} (pos {})", pos[t]),
            &got[t * qd..(t + 1) * qd],
            &want[t * qd..(t + 1) * qd],
            FLASH_TOL,
        );
    }
    let again = run();
    assert!(
        got.iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "attention_flash: a repeat differs"
    );
    // the output in the Hopper O product's 16-bit activations: the f32 output, rounded
    let ty = act_type(g);
    let att16 = g.alloc(n * qd * 2).unwrap();
    launch(abi::ATT_FLAG_OUT16 as i32, att16.ptr);
    assert_rounded(
        "attention_flash, ATT_FLAG_OUT16",
        &read_act(g, &att16, n * qd, ty),
        &got,
        ty,
    );
}

#[test]
fn ffn_norm_gate_up_silu_down_residual() {
    let Some(mut e) = env("ffn") else { return };
    let d = e.d;
    let n = 9; // more than one token tile of ffn_out
    let x = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
    let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
    let wg = Mat::new(&mut e.rng, e.wf, d.ffn, d.hidden);
    let wu = Mat::new(&mut e.rng, e.wf, d.ffn, d.hidden);
    let wd = Mat::new(&mut e.rng, e.wf, d.hidden, d.ffn);
    let mut want_h = Vec::new();
    for t in 0..n {
        let mut xn = vec![0f32; d.hidden];
        ops::rmsnorm(&x[t * d.hidden..(t + 1) * d.hidden], &norm, e.eps, &mut xn);
        let (gt, up) = (wg.matvec(&xn), wu.matvec(&xn));
        let mut h = vec![0f32; d.ffn];
        ops::swiglu(&gt, &up, &mut h);
        want_h.extend(h);
    }
    let g = &e.gpu;
    let wgu = HostMat::interleave_rows("gu", &wg.host(e.wf), &wu.host(e.wf)).unwrap();
    let (xb, nb, gub, db) = (
        g.upload(&x).unwrap(),
        g.upload(&norm).unwrap(),
        DevMat::upload(g, &wgu).unwrap(),
        DevMat::upload(g, &wd.host(e.wf)).unwrap(),
    );
    let hb = poisoned(g, n * d.ffn);
    g.ffn_in(abi::FfnIn {
        x: xb.ptr,
        norm_w: nb.ptr,
        wqs: gub.qs.ptr,
        wsc: gub.sc_ptr(),
        h: hb.ptr,
        ntok: n as i32,
    })
    .unwrap();
    check("h = silu(gate)*up", &read_f32(g, &hb, n * d.ffn), &want_h);
    // down + residual, fed with the reference h so the two kernels are checked separately
    let hb2 = g.upload(&want_h).unwrap();
    g.ffn_out(abi::FfnOut {
        h: hb2.ptr,
        wqs: db.qs.ptr,
        wsc: db.sc_ptr(),
        x: xb.ptr,
        ntok: n as i32,
    })
    .unwrap();
    let mut want_x = Vec::new();
    for t in 0..n {
        let o = wd.matvec(&want_h[t * d.ffn..(t + 1) * d.ffn]);
        want_x.extend(
            x[t * d.hidden..(t + 1) * d.hidden]
                .iter()
                .zip(&o)
                .map(|(a, b)| a + b),
        );
    }
    check("x + Wdown*h", &read_f32(g, &xb, n * d.hidden), &want_x);
}

#[test]
fn lm_head_and_device_argmax() {
    let Some(mut e) = env("lm_head") else { return };
    let d = e.d;
    let n = 4;
    let x = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
    let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
    let head = Mat::new(&mut e.rng, e.ef, d.vocab, d.hidden);
    let g = &e.gpu;
    let (xb, nb, hb) = (
        g.upload(&x).unwrap(),
        g.upload(&norm).unwrap(),
        DevMat::upload(g, &head.host(e.ef)).unwrap(),
    );
    let (pbytes, cbytes) = g.lm_head_scratch(3);
    let (part, counter) = (g.alloc(pbytes).unwrap(), g.alloc(cbytes).unwrap());
    let (ftok, flp) = (g.upload(&[-7i32; 8]).unwrap(), g.alloc(32).unwrap());
    // three outputs (lm_head, token tiles) and one (lm_head_1, the batch-1 decode kernel), sharing
    // the scratch the way the backend does; the last case leaves `logits` for the checks below
    let mut logits = Vec::new();
    let mut sel_used = Vec::new();
    for sel in [vec![2i32], vec![3, 0, 2]] {
        let sb = g.upload(&sel).unwrap();
        let lb = poisoned(g, sel.len() * d.vocab);
        let lm = abi::LmHead {
            x: xb.ptr,
            sel: sb.ptr,
            norm_w: nb.ptr,
            wqs: hb.qs.ptr,
            wsc: hb.sc_ptr(),
            logits: lb.ptr,
            ntok: sel.len() as i32,
            part: part.ptr,
            counter: counter.ptr,
            out_tok: ftok.ptr,
            out_logprob: flp.ptr,
        };
        g.lm_head(lm).unwrap();
        logits = read_f32(g, &lb, sel.len() * d.vocab);
        // the fused greedy choice, twice (the second launch checks that the tickets were re-armed)
        for round in 0..2 {
            if round == 1 {
                g.write(&ftok, 0, &[-7i32; 8]).unwrap();
                g.lm_head(lm).unwrap();
            }
            let mut ft = vec![0i32; sel.len()];
            let mut fl = vec![0f32; sel.len()];
            g.read(&ftok, 0, &mut ft).unwrap();
            g.read(&flp, 0, &mut fl).unwrap();
            for i in 0..sel.len() {
                let row = &logits[i * d.vocab..(i + 1) * d.vocab];
                let want_t = sampler::argmax(row);
                assert_eq!(
                    ft[i] as usize,
                    want_t,
                    "fused argmax, {} outputs, round {round}, row {i}",
                    sel.len()
                );
                let want_lp = row[want_t] - sampler::log_sum_exp(row);
                assert!(
                    (fl[i] - want_lp).abs() < 1e-5,
                    "fused logprob, {} outputs, row {i}: {} vs {want_lp}",
                    sel.len(),
                    fl[i]
                );
            }
        }
        let mut want = Vec::new();
        for &s in &sel {
            let mut xn = vec![0f32; d.hidden];
            ops::rmsnorm(
                &x[s as usize * d.hidden..(s as usize + 1) * d.hidden],
                &norm,
                e.eps,
                &mut xn,
            );
            want.extend(head.matvec(&xn));
        }
        check(&format!("logits ({} outputs)", sel.len()), &logits, &want);
        sel_used = sel;
    }
    let sel = sel_used;
    let lb = g.upload(&logits).unwrap();
    // argmax + logprob on the GPU's own logits must equal the host sampler's exactly / to 1e-5
    let (tb, pb) = (g.alloc(16).unwrap(), g.alloc(16).unwrap());
    let (am_part, am_counter) = {
        let (p, c) = g.argmax_scratch(40);
        (g.alloc(p).unwrap(), g.alloc(c).unwrap())
    };
    g.argmax(abi::ArgmaxLogprob {
        logits: lb.ptr,
        part: am_part.ptr,
        counter: am_counter.ptr,
        out_tok: tb.ptr,
        out_logprob: pb.ptr,
        ntok: sel.len() as i32,
    })
    .unwrap();
    let mut tok = vec![0i32; sel.len()];
    let mut lp = vec![0f32; sel.len()];
    g.read(&tb, 0, &mut tok).unwrap();
    g.read(&pb, 0, &mut lp).unwrap();
    for i in 0..sel.len() {
        let row = &logits[i * d.vocab..(i + 1) * d.vocab];
        let want_t = sampler::argmax(row);
        assert_eq!(tok[i] as usize, want_t, "row {i}");
        let want_lp = row[want_t] - sampler::log_sum_exp(row);
        assert!(
            (lp[i] - want_lp).abs() < 1e-5,
            "row {i}: logprob {} vs {want_lp}",
            lp[i]
        );
    }
    // ties pick the lowest id, NaN is never chosen
    let mut row = vec![-1.0f32; d.vocab];
    row[5] = f32::NAN;
    row[100] = 3.0;
    row[d.vocab - 1] = 3.0;
    row[7] = f32::NAN;
    let rb = g.upload(&row).unwrap();
    g.argmax(abi::ArgmaxLogprob {
        logits: rb.ptr,
        part: am_part.ptr,
        counter: am_counter.ptr,
        out_tok: tb.ptr,
        out_logprob: pb.ptr,
        ntok: 1,
    })
    .unwrap();
    g.read(&tb, 0, &mut tok[..1]).unwrap();
    assert_eq!(tok[0], 100);
    // 40 rows, each over plan::argmax_splits blocks (6 on 132 SMs), twice: the tickets re-arm,
    // the same bits
    let rows = 40;
    let many = rand_vec(&mut e.rng, rows * d.vocab, -8.0, 8.0);
    let mb = g.upload(&many).unwrap();
    let (tb, pb) = (g.alloc(rows * 4).unwrap(), g.alloc(rows * 4).unwrap());
    let mut runs = Vec::new();
    for _ in 0..2 {
        g.argmax(abi::ArgmaxLogprob {
            logits: mb.ptr,
            part: am_part.ptr,
            counter: am_counter.ptr,
            out_tok: tb.ptr,
            out_logprob: pb.ptr,
            ntok: rows as i32,
        })
        .unwrap();
        let (mut tok, mut lp) = (vec![0i32; rows], vec![0f32; rows]);
        g.read(&tb, 0, &mut tok).unwrap();
        g.read(&pb, 0, &mut lp).unwrap();
        runs.push((tok, lp.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
    }
    assert_eq!(
        runs[0], runs[1],
        "argmax over {rows} rows: two launches differ"
    );
    for (i, (&t, &lp)) in runs[0].0.iter().zip(&runs[0].1).enumerate() {
        let row = &many[i * d.vocab..(i + 1) * d.vocab];
        let want_t = sampler::argmax(row);
        assert_eq!(t as usize, want_t, "row {i} of {rows}");
        let want_lp = row[want_t] - sampler::log_sum_exp(row);
        let lp = f32::from_bits(lp);
        assert!(
            (lp - want_lp).abs() < 1e-4,
            "row {i} of {rows}: logprob {lp} vs {want_lp}"
        );
    }
    eprintln!(
        "  argmax: {rows} rows over {} blocks each agree with the host's, repeats identical",
        plan::argmax_splits(rows, d.vocab, g.sm_count)
    );
}

#[test]
fn device_sampling_matches_host_sampler() {
    use abi::device::SampleParams;
    use metrale_backend::sampler::SamplingParams;
    let Some(mut e) = env("sample_probs") else {
        return;
    };
    let v = e.d.vocab;
    let temps = [0.2f32, 0.5, 0.7, 1.0, 1.3, 0.0];
    let top_ks = [0usize, 5, 40];
    let top_ps = [1.0f32, 0.9, 0.5];
    let min_ps = [0.0f32, 0.05];
    let rows = 24;
    let mut logits = Vec::with_capacity(rows * v);
    let mut hp = Vec::new();
    let mut dp = Vec::new();
    for r in 0..rows {
        // a low background and ~60 boosted tokens (some with equal values: ties order by id)
        let mut row: Vec<f32> = (0..v).map(|_| e.rng.random_range(-30.0..-20.0)).collect();
        for k in 0..60 {
            let id = e.rng.random_range(0..v);
            row[id] = if k < 4 {
                5.0
            } else {
                e.rng.random_range(0.0..8.0)
            };
        }
        logits.extend_from_slice(&row);
        let p = SamplingParams {
            temperature: temps[r % temps.len()],
            top_k: top_ks[r % top_ks.len()],
            top_p: top_ps[(r / 2) % top_ps.len()],
            min_p: min_ps[(r / 3) % min_ps.len()],
            seed: e.rng.random(),
            ..Default::default()
        };
        let draw = e.rng.random_range(0..1000u64);
        dp.push(SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            top_k: p.top_k as i32,
            seed: p.seed,
            draw,
        });
        hp.push((p, draw));
    }
    let g = &e.gpu;
    let lb = g.upload(&logits).unwrap();
    let pb = g.upload(&dp).unwrap();
    let (tb, lpb, sb) = (
        g.upload(&vec![-1i32; rows]).unwrap(),
        g.alloc(rows * 4).unwrap(),
        g.upload(&vec![-1i32; rows]).unwrap(),
    );
    g.sample_probs(abi::SampleProbs {
        logits: lb.ptr,
        params: pb.ptr,
        out_tok: tb.ptr,
        out_logprob: lpb.ptr,
        status: sb.ptr,
        nout: rows as i32,
    })
    .unwrap();
    let (mut tok, mut lp, mut st) = (vec![0i32; rows], vec![0f32; rows], vec![0i32; rows]);
    g.read(&tb, 0, &mut tok).unwrap();
    g.read(&lpb, 0, &mut lp).unwrap();
    g.read(&sb, 0, &mut st).unwrap();
    let mut on_device = 0;
    for r in 0..rows {
        let row = &logits[r * v..(r + 1) * v];
        let (p, draw) = &hp[r];
        let want = sampler::sample(row, p, &[], *draw);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let n_cand = row
            .iter()
            .filter(|&&l| (l as f64) >= max - 30.0 * p.temperature as f64)
            .count();
        if p.temperature > 0.0 && n_cand > 2048 {
            assert_eq!(
                st[r], 0,
                "row {r}: {n_cand} candidates must fall back to the host"
            );
            continue;
        }
        assert_eq!(st[r], 1, "row {r}: status");
        assert_eq!(tok[r] as u32, want.token, "row {r}: {p:?} draw {draw}");
        assert!(
            (lp[r] - want.logprob).abs() < 1e-4,
            "row {r}: logprob {} vs {}",
            lp[r],
            want.logprob
        );
        on_device += 1;
    }
    eprintln!("  sample_probs: {on_device} of {rows} rows sampled on the device, identical to the host sampler; the rest fell back as required");
    assert!(on_device >= rows / 2);
}

/// What the Hopper GEMM path (kernels/cuda/gemm_hopper.cu.hbs, bf16 activations) may differ from
/// the f32 reference by: each activation is rounded once to bf16, a relative error uniform within
/// half a step (2^-9 to 2^-8 of the value), RMS ~1.6e-3, which the products carry over (random
/// weights average it, they do not amplify it); a bf16 KV cache adds a one-step flip (3.9e-3) of
/// the values within that error of a rounding boundary, ~3e-3 in all. Bounded at 1e-2: a wrong
/// tile, swizzle, fragment layout, nibble or block scale is an O(1) error. With quantized weights
/// (W4A16: f16 activations, each weight dequantised once to f16) the roundings are 4x smaller,
/// ~4e-4 RMS, plus the bf16 KV cache's flips; the same bound holds.
const HOPPER_TOL: f64 = 1e-2;

/// The GEMM path's four products (`GemmPath`: on Hopper with bf16 weights the wgmma kernels, else
/// the mma.sync ones) against the CPU ops, each product fed with the reference input so they are
/// checked separately, for chunks of 16, 29, 77, 160 and 300 tokens (on Hopper with bf16 weights:
/// `gemm_hopper`'s token tiles of 16, 32 and 128 below `gemm::TMA_MIN_TOKENS`, the
/// warp-specialised kernels from it, whose 300-token gate/up has more tiles than SMs, so blocks
/// loop; with quantized weights the warp-specialised `wq_*` at every count, token tiles of 16, 32,
/// 128 and 256; partial tiles, two or three tiles, and split-K where the tiles are few; then the
/// one-warpgroup ones at 16, 77 and 300), two slots, scattered positions. The mma.sync path is held to the matvec kernels' 1e-4: weights enter its MMAs
/// exactly and activations as f16 hi + lo pairs (~2^-22), so its error is f32 accumulation order;
/// the Hopper path to [`HOPPER_TOL`]. Split-K is checked to be deterministic: the output projection
/// run twice gives the same bits.
#[test]
fn gemm_prefill_products_match_cpu_ops() {
    use metrale_backend::cuda::gemm::GemmPath;
    let Some(mut e) = env("gemm") else { return };
    let d = e.d;
    let (qd, kd) = (d.qd(), d.kd());
    let w = GemmWeights {
        wq: Mat::new(&mut e.rng, e.wf, qd, d.hidden),
        wk: Mat::new(&mut e.rng, e.wf, kd, d.hidden),
        wv: Mat::new(&mut e.rng, e.wf, kd, d.hidden),
        wo: Mat::new(&mut e.rng, e.wf, d.hidden, qd),
        wg: Mat::new(&mut e.rng, e.wf, d.ffn, d.hidden),
        wu: Mat::new(&mut e.rng, e.wf, d.ffn, d.hidden),
        wd: Mat::new(&mut e.rng, e.wf, d.hidden, d.ffn),
    };
    let p = GemmPath::new(&e.gpu, 300).expect("gemm kernels");
    eprintln!(
        "  path: {}",
        if p.hopper() {
            if e.gpu.weights_bf16() {
                "Hopper (wgmma, bf16 activations)"
            } else if e.gpu.wq_gemm {
                "Hopper (warp-specialised wgmma, f16 activations, weights dequantised in registers)"
            } else {
                "Hopper (wgmma, f16 activations, weights dequantised in registers)"
            }
        } else {
            "mma.sync (f16 hi/lo)"
        }
    );
    for n in [16, 29, 77, 160, 300] {
        check_gemm_products(&mut e, &p, &w, n);
    }
    if p.hopper() && e.gpu.wn_gemm {
        // a verification step's chunk and a few sequences (the narrow wn_* kernels, split K), then
        // the same chunks on the warp-specialised kernels they stand in for
        eprintln!("  path: Hopper narrow (mma.sync, q4_1 rows streamed into registers)");
        for n in [2, 5, 8] {
            check_gemm_products(&mut e, &p, &w, n);
        }
        e.gpu.wn_gemm = false;
        eprintln!("  path: Hopper (warp-specialised wgmma) at the narrow kernels' sizes");
        for n in [5, 8] {
            check_gemm_products(&mut e, &p, &w, n);
        }
        e.gpu.wn_gemm = true;
    }
    if p.hopper() && e.gpu.wq_gemm {
        // the one-warpgroup wg_* kernels too (what `tma_gemm=off` runs): their stages read half a
        // q4_1 panel each
        e.gpu.wq_gemm = false;
        eprintln!("  path: Hopper (one-warpgroup wgmma, f16 activations, weights dequantised in registers)");
        for n in [16, 77, 300] {
            check_gemm_products(&mut e, &p, &w, n);
        }
        e.gpu.wq_gemm = true;
    }
    if p.head_pays(&d, 5) {
        check_gemm_logits(&mut e, &p);
    }
}

/// Every block tile of the warp-specialised GEMMs (`layout::TMA_CONFIGS`) and K splits of 1, 2
/// and 5 (uneven shares of K) where they fit (`plan::tma_launch`) on the output projection over 150 tokens (two 128-token tiles or
/// three 64-token tiles, the last partial), against the CPU ops within [`HOPPER_TOL`]; split
/// launches twice, which must give the same bits; then the LM head over 150 rows on its planned
/// launch, 6 of the rows checked.
#[test]
fn tma_gemm_tiles_and_splits_match_cpu_ops() {
    use metrale_backend::cuda::gemm::{GemmPath, Product};
    let Some(mut e) = env("tma") else { return };
    if !e.gpu.tma_gemm {
        eprintln!("tma: skipped: the warp-specialised GEMMs run on sm_90a cubins of bf16 targets");
        return;
    }
    let d = e.d;
    let (n, qd) = (150, d.qd());
    let wo = Mat::new(&mut e.rng, e.wf, d.hidden, qd);
    let att = rand_vec(&mut e.rng, n * qd, -1.0, 1.0);
    let x = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
    let want: Vec<f32> = {
        use rayon::prelude::*;
        (0..n)
            .into_par_iter()
            .flat_map_iter(|t| {
                let y = wo.matvec(&att[t * qd..(t + 1) * qd]);
                x[t * d.hidden..(t + 1) * d.hidden]
                    .iter()
                    .zip(y)
                    .map(|(a, b)| a + b)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let g = &e.gpu;
    let p = GemmPath::new(g, n).expect("gemm kernels");
    let wo_b = DevMat::upload(g, &wo.host(e.wf)).unwrap();
    // att as the attention kernel hands it to the O product (bf16 on this path)
    let ab = upload_act(g, &att, p.act_type());
    let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
    let nw = g.upload(&norm).unwrap();
    let mut tried = 0;
    for (cfg, &(bm, bn)) in abi::layout::TMA_CONFIGS.iter().enumerate() {
        for splits in [1, 2, 5] {
            let Some(l) = plan::tma_launch(d.hidden, qd, n, cfg, splits, g.sm_count, true) else {
                continue;
            };
            let what = format!("tma {bm}x{bn} splits {splits}: x + Wo*att");
            let mut bits = Vec::new();
            for _ in 0..if splits > 1 { 2 } else { 1 } {
                let xo = g.upload(&x).unwrap();
                // with the next product's input (the gate/up's: any norm weight) on even launches
                let next = (bits.len() % 2 == 0).then_some(nw.ptr);
                let o = Product::Out {
                    att: ab.ptr,
                    x: xo.ptr,
                    next,
                };
                p.tma_product(g, o, &wo_b, n, l).unwrap();
                let got = read_f32(g, &xo, n * d.hidden);
                check_tol(&what, &got, &want, HOPPER_TOL);
                if next.is_some() {
                    check_next_input(&what, g, &p, &got, &norm, n, d.hidden);
                }
                bits.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            assert!(
                bits.windows(2).all(|w| w[0] == w[1]),
                "{what}: two runs differ"
            );
            tried += 1;
        }
    }
    // SmolLM2's 576 rows take only the 192-row tiles; the 8B's 4096 every one
    eprintln!("  {tried} tile/split launches fit this shape");
    assert!(
        tried >= 1,
        "no warp-specialised launch fits {} rows",
        d.hidden
    );
    // the LM head over n rows (from gemm::TMA_MIN_TOKENS on the warp-specialised kernels)
    if p.head_pays(&d, n) {
        let xh = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
        let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
        let head = Mat::new(&mut e.rng, e.ef, d.vocab, d.hidden);
        let sel: Vec<i32> = (0..n as i32).rev().collect();
        let (xb, nb, hb, sb) = (
            g.upload(&xh).unwrap(),
            g.upload(&norm).unwrap(),
            DevMat::upload(g, &head.host(e.ef)).unwrap(),
            g.upload(&sel).unwrap(),
        );
        let lb = poisoned(g, n * d.vocab);
        p.logits(g, xb.ptr, sb.ptr, nb.ptr, &hb, lb.ptr, n).unwrap();
        let all = read_f32(g, &lb, n * d.vocab);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for t in [0, 1, 63, 64, 128, n - 1] {
            let s = sel[t] as usize;
            let mut xn = vec![0f32; d.hidden];
            ops::rmsnorm(&xh[s * d.hidden..(s + 1) * d.hidden], &norm, e.eps, &mut xn);
            want.extend(head.matvec(&xn));
            got.extend_from_slice(&all[t * d.vocab..(t + 1) * d.vocab]);
        }
        check_tol(
            &format!("gemm logits over {n} rows, 6 checked (planned launch)"),
            &got,
            &want,
            HOPPER_TOL,
        );
        assert!(
            all.iter().all(|v| v.is_finite()),
            "an LM-head row left unwritten"
        );
    }
}

/// The Hopper path's LM head (`GemmPath::logits`: bf16(RMSNorm(x[sel])) times the head) for 5
/// selected rows of 9, against the CPU ops within [`HOPPER_TOL`].
fn check_gemm_logits(e: &mut Env, p: &metrale_backend::cuda::gemm::GemmPath) {
    let d = e.d;
    let x = rand_vec(&mut e.rng, 9 * d.hidden, -1.0, 1.0);
    let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
    let head = Mat::new(&mut e.rng, e.ef, d.vocab, d.hidden);
    let sel = [8i32, 0, 3, 3, 5];
    let g = &e.gpu;
    let (xb, nb, hb, sb) = (
        g.upload(&x).unwrap(),
        g.upload(&norm).unwrap(),
        DevMat::upload(g, &head.host(e.ef)).unwrap(),
        g.upload(&sel).unwrap(),
    );
    let lb = poisoned(g, sel.len() * d.vocab);
    p.logits(g, xb.ptr, sb.ptr, nb.ptr, &hb, lb.ptr, sel.len())
        .unwrap();
    let mut want = Vec::new();
    for &s in &sel {
        let mut xn = vec![0f32; d.hidden];
        let s = s as usize;
        ops::rmsnorm(&x[s * d.hidden..(s + 1) * d.hidden], &norm, e.eps, &mut xn);
        want.extend(head.matvec(&xn));
    }
    check_tol(
        "gemm logits (Hopper, 5 selected rows)",
        &read_f32(g, &lb, sel.len() * d.vocab),
        &want,
        HOPPER_TOL,
    );
}

struct GemmWeights {
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    wg: Mat,
    wu: Mat,
    wd: Mat,
}

fn check_gemm_products(
    e: &mut Env,
    p: &metrale_backend::cuda::gemm::GemmPath,
    w: &GemmWeights,
    n: usize,
) {
    use metrale_backend::cuda::gemm::{Product, QkvOut};
    use rayon::prelude::*;
    let d = e.d;
    let (qd, hd) = (d.qd(), d.head_dim);
    let slots = 2;
    let ctx = 256;
    let layer = d.layers - 1;
    // the first three quarters in slot 0 at positions 0.., the rest in slot 1 from the end, every 3rd
    let n0 = n * 3 / 4;
    let pos: Vec<i32> = (0..n)
        .map(|i| {
            if i < n0 {
                i as i32
            } else {
                (ctx - 1 - (i - n0) * 3) as i32
            }
        })
        .collect();
    let slot: Vec<i32> = (0..n).map(|i| (i >= n0) as i32).collect();
    let x = rand_vec(&mut e.rng, n * d.hidden, -1.0, 1.0);
    let norm = rand_vec(&mut e.rng, d.hidden, 0.5, 1.5);
    let att = rand_vec(&mut e.rng, n * qd, -1.0, 1.0);
    let (tol, what) = if p.hopper() {
        (HOPPER_TOL, format!("gemm n={n} (Hopper) "))
    } else {
        (TOL, format!("gemm n={n} "))
    };
    let g = &e.gpu;
    let inv = rope_inv_freq(hd, e.theta, None, None);
    let rope = g.upload(&rope_table(&inv, ctx)).unwrap();
    let (wq, wk, wv) = (&w.wq, &w.wk, &w.wv);
    let wqkv = HostMat::concat_rows("qkv", &[wq.host(e.wf), wk.host(e.wf), wv.host(e.wf)]).unwrap();
    let wgu = HostMat::interleave_rows("gu", &w.wg.host(e.wf), &w.wu.host(e.wf)).unwrap();
    let (wqkv_b, wo_b, wgu_b, wd_b) = (
        DevMat::upload(g, &wqkv).unwrap(),
        DevMat::upload(g, &w.wo.host(e.wf)).unwrap(),
        DevMat::upload(g, &wgu).unwrap(),
        DevMat::upload(g, &w.wd.host(e.wf)).unwrap(),
    );
    let (xb, nb, pb, sb) = (
        g.upload(&x).unwrap(),
        g.upload(&norm).unwrap(),
        g.upload(&pos).unwrap(),
        g.upload(&slot).unwrap(),
    );

    // RMSNorm + QKV + RoPE + KV write
    let qb = poisoned(g, n * q_cols(e));
    let pg = Paged::new(d, slots, ctx, e.kv);
    let kc = pg.upload(g, &vec![1e30f32; pg.elems()]);
    let vc = pg.upload(g, &vec![1e30f32; pg.elems()]);
    let tb = g.upload(&pg.tables).unwrap();
    let o = QkvOut {
        rope: rope.ptr,
        q: qb.ptr,
        kc: kc.ptr,
        vc: vc.ptr,
        pos: pb.ptr,
        slot: sb.ptr,
        tables: tb.ptr,
        layer: layer as i32,
        max_blocks: pg.max_blocks as i32,
    };
    p.norm_qkv(g, xb.ptr, nb.ptr, &wqkv_b, o, n).unwrap();
    let (q, kcache, vcache) = (qkv_finish(e, &o, &qb, n), pg.read(g, &kc), pg.read(g, &vc));
    let qkv_r = QkvRef {
        x: &x,
        norm: &norm,
        wq,
        wk,
        wv,
        inv: &inv,
        qkn: e.qkn.as_ref().map(|(w, _)| &w[..]),
        bias: e.bias.as_ref().map(|(b, _)| &b[..]),
    };
    check_qkv(
        &what,
        d,
        e.eps,
        qkv_r,
        (&pos, &slot, layer, &pg),
        (&q, &kcache, &vcache),
        p.hopper().then_some(tol),
    );
    // the warp-specialised tiles only the QKV product takes (the O test, `tma_gemm_tiles_and_
    // splits_match_cpu_ops`, reaches the rest), over the activations norm_qkv left in the scratch
    if p.hopper() && g.tma_gemm && (n == 77 || n == 300) {
        for (cfg, &(bm, bn)) in abi::layout::TMA_CONFIGS.iter().enumerate() {
            if d.hidden.is_multiple_of(bn) && plan::tma_norm_out(cfg) {
                continue;
            }
            for splits in [1, 2] {
                let Some(l) =
                    plan::tma_launch(wqkv_b.rows, d.hidden, n, cfg, splits, g.sm_count, false)
                else {
                    continue;
                };
                let qb = poisoned(g, n * q_cols(e));
                let kc = pg.upload(g, &vec![1e30f32; pg.elems()]);
                let vc = pg.upload(g, &vec![1e30f32; pg.elems()]);
                let o = QkvOut {
                    q: qb.ptr,
                    kc: kc.ptr,
                    vc: vc.ptr,
                    ..o
                };
                p.hopper_product(g, Product::Qkv(o), &wqkv_b, n, Some(l))
                    .unwrap();
                let q = qkv_finish(e, &o, &qb, n);
                check_qkv(
                    &format!("{what}tma {bm}x{bn} splits {splits}: "),
                    d,
                    e.eps,
                    qkv_r,
                    (&pos, &slot, layer, &pg),
                    (&q, &pg.read(g, &kc), &pg.read(g, &vc)),
                    Some(tol),
                );
            }
        }
    }
    // SiLU(gate) * up of RMSNorm(x) for every token of a residual x
    let ffn_ref = |x: &[f32]| -> Vec<f32> {
        (0..n)
            .into_par_iter()
            .flat_map_iter(|t| {
                let mut xn = vec![0f32; d.hidden];
                ops::rmsnorm(&x[t * d.hidden..(t + 1) * d.hidden], &norm, e.eps, &mut xn);
                let mut hrow = vec![0f32; d.ffn];
                ops::swiglu(&w.wg.matvec(&xn), &w.wu.matvec(&xn), &mut hrow);
                hrow
            })
            .collect()
    };
    let want_h = ffn_ref(&x);

    // RMSNorm + gate/up + SiLU
    let hb = poisoned(g, n * d.ffn);
    p.norm_gate_up(g, xb.ptr, nb.ptr, &wgu_b, hb.ptr, n)
        .unwrap();
    // the Hopper path leaves h in the down product's 16-bit type: within the bound as it is
    check_tol(
        &format!("{what}h = silu(gate)*up ({:?})", p.act_type()),
        &read_act(g, &hb, n * d.ffn, p.act_type()),
        &want_h,
        tol,
    );

    // output projection + residual (twice: split-K must give the same bits), then down projection
    // + residual (reference inputs)
    let ab = upload_act(g, &att, p.act_type());
    let (xo, xo2) = (g.upload(&x).unwrap(), g.upload(&x).unwrap());
    p.out_proj(g, ab.ptr, &wo_b, xo.ptr, n, None).unwrap();
    p.out_proj(g, ab.ptr, &wo_b, xo2.ptr, n, None).unwrap();
    let hb2 = upload_act(g, &want_h, p.act_type());
    let xd = g.upload(&x).unwrap();
    p.down(g, hb2.ptr, &wd_b, xd.ptr, n, None).unwrap();
    let plus = |m: &Mat, a: &[f32], k: usize| -> Vec<f32> {
        (0..n)
            .into_par_iter()
            .flat_map_iter(|t| {
                let xr = &x[t * d.hidden..(t + 1) * d.hidden];
                let y = m.matvec(&a[t * k..(t + 1) * k]);
                xr.iter().zip(y).map(|(a, b)| a + b).collect::<Vec<_>>()
            })
            .collect()
    };
    let got_xo = read_f32(g, &xo, n * d.hidden);
    check_tol(
        &format!("{what}x + Wo*att"),
        &got_xo,
        &plus(&w.wo, &att, qd),
        tol,
    );
    assert!(
        got_xo
            .iter()
            .zip(read_f32(g, &xo2, n * d.hidden))
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}x + Wo*att: two runs differ"
    );
    check_tol(
        &format!("{what}x + Wdown*h"),
        &read_f32(g, &xd, n * d.hidden),
        &plus(&w.wd, &want_h, d.ffn),
        tol,
    );
    if !p.hopper() {
        return;
    }

    // The fused norm: the O product also writes the gate/up product's input (the residual it
    // wrote, the same bits as without), which gate/up then reads with no conversion; the down
    // product the next QKV product's.
    let xo3 = g.upload(&x).unwrap();
    p.out_proj(g, ab.ptr, &wo_b, xo3.ptr, n, Some(nb.ptr))
        .unwrap();
    let got_xo3 = read_f32(g, &xo3, n * d.hidden);
    assert!(
        got_xo
            .iter()
            .zip(&got_xo3)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}x + Wo*att: the residual differs where the O product also writes the next input"
    );
    check_next_input(
        &format!("{what}O product's next input"),
        g,
        p,
        &got_xo3,
        &norm,
        n,
        d.hidden,
    );
    let hb3 = poisoned(g, n * d.ffn);
    p.gate_up(g, &wgu_b, hb3.ptr, n).unwrap();
    let want_h3 = ffn_ref(&got_xo3);
    check_tol(
        &format!("{what}h = silu(gate)*up of the O product's normed output"),
        &read_act(g, &hb3, n * d.ffn, p.act_type()),
        &want_h3,
        tol,
    );
    let xd3 = g.upload(&x).unwrap();
    p.down(g, hb2.ptr, &wd_b, xd3.ptr, n, Some(nb.ptr)).unwrap();
    let got_xd3 = read_f32(g, &xd3, n * d.hidden);
    check_next_input(
        &format!("{what}down product's next input"),
        g,
        p,
        &got_xd3,
        &norm,
        n,
        d.hidden,
    );
    let qb3 = poisoned(g, n * q_cols(e));
    let kc3 = pg.upload(g, &vec![1e30f32; pg.elems()]);
    let vc3 = pg.upload(g, &vec![1e30f32; pg.elems()]);
    let o3 = QkvOut {
        q: qb3.ptr,
        kc: kc3.ptr,
        vc: vc3.ptr,
        ..o
    };
    p.qkv(g, &wqkv_b, o3, n).unwrap();
    let (q, kcache, vcache) = (
        qkv_finish(e, &o3, &qb3, n),
        pg.read(g, &kc3),
        pg.read(g, &vc3),
    );
    let qkv_r = QkvRef {
        x: &got_xd3,
        norm: &norm,
        wq,
        wk,
        wv,
        inv: &inv,
        qkn: e.qkn.as_ref().map(|(w, _)| &w[..]),
        bias: e.bias.as_ref().map(|(b, _)| &b[..]),
    };
    check_qkv(
        &format!("{what}(QKV of the down product's normed output) "),
        d,
        e.eps,
        qkv_r,
        (&pos, &slot, layer, &pg),
        (&q, &kcache, &vcache),
        Some(tol),
    );
}

/// What an O or down product with a next norm leaves for the product after it (`GemmPath::qkv`,
/// `gate_up`), from the residual `x` it wrote: the activations act(x * norm) bit for bit (the
/// kernels round the same f32 product), and each 32 columns' squares (`abi::SS_COLS`) within 1e-5
/// (their order of addition is the kernel's).
fn check_next_input(
    what: &str,
    g: &Gpu,
    p: &metrale_backend::cuda::gemm::GemmPath,
    x: &[f32],
    norm: &[f32],
    n: usize,
    hidden: usize,
) {
    let (hi, ss) = p.norm_scratch();
    let cols = abi::SS_COLS as usize;
    let ty = p.act_type();
    let mut a = vec![0u16; n * hidden];
    g.read(hi, 0, &mut a).unwrap();
    let got_ss = read_f32(g, ss, n * hidden / cols);
    for t in 0..n {
        let row = &x[t * hidden..(t + 1) * hidden];
        for (c, (&v, &w)) in row.iter().zip(norm).enumerate() {
            let want = act_bits(v * w, ty);
            assert_eq!(
                a[t * hidden + c],
                want,
                "{what}: token {t} column {c}: act(x * norm) {} against {}",
                act_f32(a[t * hidden + c], ty),
                act_f32(want, ty)
            );
        }
        for (c, chunk) in row.chunks(cols).enumerate() {
            let want: f64 = chunk.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let got = got_ss[t * hidden / cols + c] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.max(1e-30),
                "{what}: token {t} squares of columns {}..{}: {got} against {want}",
                c * cols,
                (c + 1) * cols
            );
        }
    }
    eprintln!("  {what}: act(x * norm) exact, squares within 1e-5 ({n} tokens)");
}

/// `mask_logits` against the host's `sampler::apply_mask`: random grammar masks on some rows (row
/// order shuffled against the mask rows, one row unmasked), exactly; then `argmax_logprob` on the
/// masked rows gives the host sampler's greedy choice.
#[test]
fn grammar_masks_on_the_device_match_the_host() {
    use metrale_backend::sampler::{self as hs, SamplingParams};
    let Some(mut e) = env("mask_logits") else {
        return;
    };
    let v = e.d.vocab;
    let words = v.div_ceil(32);
    let rows = 6;
    let logits: Vec<f32> = (0..rows * v)
        .map(|_| e.rng.random_range(-8.0..8.0))
        .collect();
    // mask row m allows about 1/(m+2) of the vocabulary; output rows take them in another order
    let masks: Vec<u32> = (0..rows - 1)
        .flat_map(|m| {
            let keep = (m + 2) as u32;
            (0..words)
                .map(|_| {
                    (0..32).fold(0u32, |w, b| {
                        w | ((e.rng.random_range(0..keep) == 0) as u32) << b
                    })
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let row_of: [i32; 6] = [3, -1, 0, 4, 1, 2];
    let g = &e.gpu;
    // argmax_masked_1 first, on the unmasked rows: each row with its mask (null for row 1), one
    // launch over the row's blocks, the ticket re-armed between launches
    let blocks = plan::row_blocks(v) as usize;
    let part = g.alloc(blocks * abi::ACC_BYTES as usize).unwrap();
    let counter = g.alloc(4).unwrap();
    let one = (g.alloc(4).unwrap(), g.alloc(4).unwrap());
    let mut fused: Vec<(i32, f32)> = Vec::new();
    for (t, &m) in row_of.iter().enumerate() {
        let lrow = g.upload(&logits[t * v..(t + 1) * v]).unwrap();
        let mrow = (m >= 0).then(|| {
            g.upload(&masks[m as usize * words..(m as usize + 1) * words])
                .unwrap()
        });
        g.argmax_masked_1(abi::ArgmaxMaskedOne {
            logits: lrow.ptr,
            masks: mrow.as_ref().map_or(0, |b| b.ptr),
            part: part.ptr,
            counter: counter.ptr,
            out_tok: one.0.ptr,
            out_logprob: one.1.ptr,
        })
        .unwrap();
        let (mut tk, mut l) = ([0i32], [0f32]);
        g.read(&one.0, 0, &mut tk).unwrap();
        g.read(&one.1, 0, &mut l).unwrap();
        fused.push((tk[0], l[0]));
    }
    let lb = g.upload(&logits).unwrap();
    let mb = g.upload(&masks).unwrap();
    let rb = g.upload(&row_of).unwrap();
    g.mask_logits(abi::MaskLogits {
        logits: lb.ptr,
        masks: mb.ptr,
        rows: rb.ptr,
        nout: rows as i32,
    })
    .unwrap();
    let (tb, lpb) = (g.alloc(rows * 4).unwrap(), g.alloc(rows * 4).unwrap());
    let (am_part, am_counter) = {
        let (p, c) = g.argmax_scratch(rows);
        (g.alloc(p).unwrap(), g.alloc(c).unwrap())
    };
    g.argmax(abi::ArgmaxLogprob {
        logits: lb.ptr,
        part: am_part.ptr,
        counter: am_counter.ptr,
        out_tok: tb.ptr,
        out_logprob: lpb.ptr,
        ntok: rows as i32,
    })
    .unwrap();
    let got = read_f32(g, &lb, rows * v);
    let (mut tok, mut lp) = (vec![0i32; rows], vec![0f32; rows]);
    g.read(&tb, 0, &mut tok).unwrap();
    g.read(&lpb, 0, &mut lp).unwrap();
    for (t, &m) in row_of.iter().enumerate() {
        let mut want = logits[t * v..(t + 1) * v].to_vec();
        if m >= 0 {
            hs::apply_mask(
                &mut want,
                &masks[m as usize * words..(m as usize + 1) * words],
            );
        }
        let row = &got[t * v..(t + 1) * v];
        assert!(
            row.iter()
                .zip(&want)
                .all(|(a, b)| a == b || (a.is_infinite() && b.is_infinite())),
            "row {t} (mask row {m}): masked logits differ"
        );
        let pick = hs::sample(&want, &SamplingParams::default(), &[], 0);
        assert_eq!(tok[t] as u32, pick.token, "row {t}: greedy choice");
        assert!((lp[t] - pick.logprob).abs() < 1e-4, "row {t}: logprob");
        assert_eq!(
            fused[t].0 as u32, pick.token,
            "row {t}: argmax_masked_1's choice"
        );
        assert!(
            (fused[t].1 - pick.logprob).abs() < 1e-4,
            "row {t}: argmax_masked_1's logprob {} against {}",
            fused[t].1,
            pick.logprob
        );
    }
    eprintln!(
        "  mask_logits: {rows} rows ({} masked) equal to the host's apply_mask; arg-max agrees, and argmax_masked_1 over {blocks} blocks",
        rows - 1
    );
}

/// The routed experts (`moe.cu.hbs`: `moe_route`, `moe_gu`, `moe_down`; for many tokens grouped by
/// expert: `moe_sort`, `moe_gu_grouped` / `moe_down_grouped` or the tensor-core `moe_gu_mma` /
/// `moe_down_mma` after their splits, `moe_combine`) on targets whose family has them, against
/// the CPU reference (`cpu::route`, the ops) over 6 tokens at the target's shape (every expert's
/// matrices random, stacked as the loader stacks them; the router's rows spread over several
/// blocks a token). Token 2's input is zero, so every router logit is exactly 0 and all experts
/// tie: the kernel must take experts 0..used, each weighted 1/used (ties go to the lower index),
/// and leave that residual row unchanged. The chosen experts must be the reference's exactly;
/// their weights within [`MOE_WEIGHT_TOL`]; the residual within [`TOL`] (f32 sums in another order;
/// [`MOE_A16_TOL`] for the matrix-vector kernels on q4_1); the expert histogram (`counts`) every
/// choice once; the router's tickets re-armed. A prompt chunk's routing (1,030 tokens, a block a
/// tile of tokens) bit-identical to the same tokens routed five at a time.
/// How far a routed expert's weight may lie from the CPU's: each router logit sums 2,048 products
/// (at 30B-A3B) four to a lane and then across the warp, the CPU one after another, so the logits
/// differ by ~1e-6 of their size, and a renormalised top-k weight (below 1) moves by about as much
/// as the logits' difference (1.05e-6 seen once in 48 weights at random inputs: 1e-6 was too
/// tight). A wrong expert or a missing renormalisation is off by 1e-2 or more.
const MOE_WEIGHT_TOL: f32 = 1e-5;

#[test]
fn moe_routing_and_experts_match_cpu() {
    let Some(mut e) = env("moe") else { return };
    let Some(m) = e.gpu.moe else {
        eprintln!("moe: skipped: the target's family has no routed experts");
        return;
    };
    let d = e.d;
    let (h, n) = (d.hidden, 6);
    let mut x = rand_vec(&mut e.rng, n * h, -1.0, 1.0);
    x[2 * h..3 * h].fill(0.0);
    let norm = rand_vec(&mut e.rng, h, 0.5, 1.5);
    let router = rand_vec(&mut e.rng, m.experts * h, -0.05, 0.05);
    let t0 = std::time::Instant::now();
    let gate: Vec<Mat> = (0..m.experts)
        .map(|_| Mat::new(&mut e.rng, e.wf, m.ffn, h))
        .collect();
    let up: Vec<Mat> = (0..m.experts)
        .map(|_| Mat::new(&mut e.rng, e.wf, m.ffn, h))
        .collect();
    let down: Vec<Mat> = (0..m.experts)
        .map(|_| Mat::new(&mut e.rng, e.wf, h, m.ffn))
        .collect();
    let gu: Vec<HostMat> = (0..m.experts)
        .map(|i| HostMat::interleave_rows("gu", &gate[i].host(e.wf), &up[i].host(e.wf)).unwrap())
        .collect();
    let gu = HostMat::concat_rows("gu", &gu).unwrap();
    let dn: Vec<HostMat> = down.iter().map(|w| w.host(e.wf)).collect();
    let dn = HostMat::concat_rows("down", &dn).unwrap();
    eprintln!(
        "  {} experts' matrices made in {:.1} s",
        m.experts,
        t0.elapsed().as_secs_f64()
    );
    let g = &e.gpu;
    let (xb, nb, rb) = (
        g.upload(&x).unwrap(),
        g.upload(&norm).unwrap(),
        g.upload(&router).unwrap(),
    );
    let (gub, dnb) = (
        DevMat::upload(g, &gu).unwrap(),
        DevMat::upload(g, &dn).unwrap(),
    );
    let xn = poisoned(g, n * h);
    let ids = g.upload(&vec![-1i32; n * m.used]).unwrap();
    let wts = poisoned(g, n * m.used);
    let hb = poisoned(g, n * m.used * m.ffn);
    let counts = g.upload(&vec![0u32; m.experts]).unwrap();
    // the router's scratch for up to 133 tokens; the tickets must be re-armed after every launch
    const MOST: usize = 133;
    let (logits, ticket) = (
        poisoned(g, MOST * m.experts),
        g.upload(&[0u32; MOST]).unwrap(),
    );
    assert!(
        g.moe_router_blocks(n.div_ceil(abi::MOE_ROUTE_TOKENS as usize)) > 1,
        "6 tokens spread their router rows"
    );
    g.moe_route(abi::MoeRoute {
        x: xb.ptr,
        norm_w: nb.ptr,
        router: rb.ptr,
        xn: xn.ptr,
        ids: ids.ptr,
        wts: wts.ptr,
        counts: counts.ptr,
        logits: logits.ptr,
        ticket: ticket.ptr,
        ntok: n as i32,
    })
    .unwrap();
    g.moe_gu(abi::MoeGu {
        xn: xn.ptr,
        wqs: gub.qs.ptr,
        wsc: gub.sc_ptr(),
        ids: ids.ptr,
        norm_w: 0,
        racc: 0,
        wts: 0,
        counts: 0,
        h: hb.ptr,
        ntok: n as i32,
    })
    .unwrap();
    g.moe_down(abi::MoeDown {
        h: hb.ptr,
        wqs: dnb.qs.ptr,
        wsc: dnb.sc_ptr(),
        ids: ids.ptr,
        wts: wts.ptr,
        x: xb.ptr,
        racc: 0,
        ntok: n as i32,
    })
    .unwrap();
    let mut got_ids = vec![0i32; n * m.used];
    g.read(&ids, 0, &mut got_ids).unwrap();
    let got_w = read_f32(g, &wts, n * m.used);
    let got_x = read_f32(g, &xb, n * h);
    // The CPU reference for one token's row: the experts chosen (ascending, with their weights)
    // and x + the weighted sum of their outputs.
    let reference = |x: &[f32]| -> (Vec<(usize, f32)>, Vec<f32>) {
        let mut xn = vec![0f32; h];
        ops::rmsnorm(x, &norm, e.eps, &mut xn);
        let logits: Vec<f32> = router
            .chunks_exact(h)
            .map(|r| r.iter().zip(&xn).map(|(a, b)| a * b).sum())
            .collect();
        let mut chosen = metrale_backend::cpu::route(&logits, m.used, true);
        chosen.sort_by_key(|&(ex, _)| ex);
        let mut out = x.to_vec();
        for &(ex, wgt) in &chosen {
            let (gv, mut uv) = (gate[ex].matvec(&xn), up[ex].matvec(&xn));
            ops::swiglu_inplace(&gv, &mut uv);
            for (o, v) in out.iter_mut().zip(down[ex].matvec(&uv)) {
                *o += wgt * v;
            }
        }
        (chosen, out)
    };
    let mut want_x = Vec::with_capacity(n * h);
    for t in 0..n {
        let (chosen, row) = reference(&x[t * h..(t + 1) * h]);
        want_x.extend(row);
        let ids_t: Vec<i32> = chosen.iter().map(|&(ex, _)| ex as i32).collect();
        assert_eq!(
            &got_ids[t * m.used..(t + 1) * m.used],
            &ids_t[..],
            "token {t}: experts"
        );
        if t == 2 {
            assert_eq!(
                ids_t,
                (0..m.used as i32).collect::<Vec<_>>(),
                "a full tie takes the lowest"
            );
        }
        for (k, &(ex, wgt)) in chosen.iter().enumerate() {
            let gw = got_w[t * m.used + k];
            assert!(
                (gw - wgt).abs() <= MOE_WEIGHT_TOL,
                "token {t} expert {ex}: weight {gw} vs {wgt}"
            );
        }
    }
    assert!(
        got_x[2 * h..3 * h].iter().all(|&v| v == 0.0),
        "the tied token's residual stays 0"
    );
    assert_eq!(
        read_counts(g, &counts, m.experts),
        histogram(&got_ids, m.experts, 1),
        "the expert histogram counts every choice once"
    );
    let mv_tol = match e.wf {
        DevFormat::Q4_1 => MOE_A16_TOL,
        _ => TOL,
    };
    check_tol(
        "moe: x + sum of the routed experts' outputs",
        &got_x,
        &want_x,
        mv_tol,
    );
    eprintln!(
        "  moe: {n} tokens routed as the CPU routes them (one full tie), weights within {MOE_WEIGHT_TOL:e}"
    );

    // One token's O product with its routing sums (moe_out_route), moe_gu routing from them in
    // every block and normalising the residual itself, moe_down zeroing them, against the
    // launches they replace (attn_out, moe_route, moe_gu on xn, moe_down): the residual after O
    // bit for bit (the same product and adds), the same experts, their weights within
    // MOE_WEIGHT_TOL (the logits summed over the rows in another order, in fixed point, the
    // norm's weights folded into the router's columns: ~1e-6 of their size, as between
    // moe_route and the CPU), h and the residual after down within the tolerance of the products
    // against the CPU (mv_tol: the staged row normed by another sum; i16 activations may round
    // an element the other way); twice, so the sums must be zeroed by moe_down; the histogram
    // counted. A zero residual and attention output: every logit 0, experts 0..used.
    if g.moe_route_fused {
        let qd = d.qd();
        let wo = Mat::new(&mut e.rng, e.wf, h, qd);
        let wob = DevMat::upload(g, &wo.host(e.wf)).unwrap();
        let rcols = g
            .upload(&metrale_backend::cuda::weights::router_columns(
                &router, &norm,
            ))
            .unwrap();
        let racc = g.upload(&vec![0u64; m.experts + 1]).unwrap();
        let mut cases = 0;
        for zero in [false, true] {
            let mut att = rand_vec(&mut e.rng, qd, -1.0, 1.0);
            let mut x1 = rand_vec(&mut e.rng, h, -1.0, 1.0);
            if zero {
                att.fill(0.0);
                x1.fill(0.0);
            }
            let atb = g.upload(&att).unwrap();
            // a fresh residual, routing and h for each path
            let fresh = || {
                (
                    g.upload(&x1).unwrap(),
                    g.upload(&vec![-1i32; m.used]).unwrap(),
                    poisoned(g, m.used),
                    poisoned(g, m.used * m.ffn),
                )
            };
            let down = |h: &DevBuf, ids: &DevBuf, wts: &DevBuf, x: &DevBuf, racc: u64| {
                g.moe_down(abi::MoeDown {
                    h: h.ptr,
                    wqs: dnb.qs.ptr,
                    wsc: dnb.sc_ptr(),
                    ids: ids.ptr,
                    wts: wts.ptr,
                    x: x.ptr,
                    racc,
                    ntok: 1,
                })
                .unwrap()
            };
            let (xa, ids_a, wts_a, ha) = fresh();
            g.attn_out(abi::AttnOut {
                att: atb.ptr,
                wqs: wob.qs.ptr,
                wsc: wob.sc_ptr(),
                x: xa.ptr,
                ntok: 1,
            })
            .unwrap();
            let want_xo = read_f32(g, &xa, h);
            g.moe_route(abi::MoeRoute {
                x: xa.ptr,
                norm_w: nb.ptr,
                router: rb.ptr,
                xn: xn.ptr,
                ids: ids_a.ptr,
                wts: wts_a.ptr,
                counts: 0,
                logits: logits.ptr,
                ticket: ticket.ptr,
                ntok: 1,
            })
            .unwrap();
            g.moe_gu(abi::MoeGu {
                xn: xn.ptr,
                wqs: gub.qs.ptr,
                wsc: gub.sc_ptr(),
                ids: ids_a.ptr,
                norm_w: 0,
                racc: 0,
                wts: 0,
                counts: 0,
                h: ha.ptr,
                ntok: 1,
            })
            .unwrap();
            let want_h = read_f32(g, &ha, m.used * m.ffn);
            down(&ha, &ids_a, &wts_a, &xa, 0);
            let want_x = read_f32(g, &xa, h);
            let mut want_ids = vec![0i32; m.used];
            g.read(&ids_a, 0, &mut want_ids).unwrap();
            let want_w = read_f32(g, &wts_a, m.used);
            let fcounts = g.upload(&vec![0u32; m.experts]).unwrap();
            for round in 0..2 {
                let (xf, ids_f, wts_f, hf) = fresh();
                g.moe_out_route(abi::MoeOutRoute {
                    att: atb.ptr,
                    wqs: wob.qs.ptr,
                    wsc: wob.sc_ptr(),
                    x: xf.ptr,
                    rcols: rcols.ptr,
                    racc: racc.ptr,
                })
                .unwrap();
                let what = format!(
                    "moe_out_route ({}, launch {round})",
                    if zero { "zero input" } else { "random" }
                );
                let got_xo = read_f32(g, &xf, h);
                assert!(
                    got_xo
                        .iter()
                        .zip(&want_xo)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: the residual differs from attn_out's"
                );
                g.moe_gu(abi::MoeGu {
                    xn: xf.ptr,
                    wqs: gub.qs.ptr,
                    wsc: gub.sc_ptr(),
                    ids: ids_f.ptr,
                    norm_w: nb.ptr,
                    racc: racc.ptr,
                    wts: wts_f.ptr,
                    counts: fcounts.ptr,
                    h: hf.ptr,
                    ntok: 1,
                })
                .unwrap();
                let mut got_ids = vec![0i32; m.used];
                g.read(&ids_f, 0, &mut got_ids).unwrap();
                assert_eq!(got_ids, want_ids, "{what}: experts");
                if zero {
                    assert_eq!(
                        got_ids,
                        (0..m.used as i32).collect::<Vec<_>>(),
                        "{what}: a full tie takes the lowest"
                    );
                }
                for (k, (gw, ww)) in read_f32(g, &wts_f, m.used).iter().zip(&want_w).enumerate() {
                    assert!(
                        (gw - ww).abs() <= MOE_WEIGHT_TOL,
                        "{what}: weight {k}: {gw} vs {ww}"
                    );
                }
                check_tol(
                    &format!("{what}: h"),
                    &read_f32(g, &hf, m.used * m.ffn),
                    &want_h,
                    mv_tol,
                );
                down(&hf, &ids_f, &wts_f, &xf, racc.ptr);
                check_tol(
                    &format!("{what}: x after moe_down"),
                    &read_f32(g, &xf, h),
                    &want_x,
                    mv_tol,
                );
                let mut acc = vec![1u64; m.experts + 1];
                g.read(&racc, 0, &mut acc).unwrap();
                assert!(
                    acc.iter().all(|&v| v == 0),
                    "{what}: moe_down zeroes the sums"
                );
                cases += 1;
            }
            assert_eq!(
                read_counts(g, &fcounts, m.experts),
                histogram(&want_ids, m.experts, 2),
                "moe_gu counts each choice once a launch"
            );
        }
        eprintln!(
            "  moe_out_route: {cases} launches over {} blocks: the residual bit for bit, the experts and weights of attn_out + moe_route",
            g.moe_out_route_blocks()
        );
    }

    // Many tokens, grouped by expert (moe_sort, then moe_gu_grouped and moe_down_grouped on the
    // CUDA cores or moe_split_x, moe_gu_mma, moe_split_h and moe_down_mma on the tensor cores,
    // then moe_combine): on the same 133 tokens, the CUDA-core kernels give the per-pair kernels'
    // bits, both paths the CPU's sums. Tokens 0..37 share one row, so their experts take 37
    // pairs and more each: several tiles of the CUDA-core kernels, two or more of the GEMMs; the
    // other 96 are random (every expert taken, 34 routing tiles of 4 tokens, the last of one).
    #[derive(Clone, Copy, PartialEq)]
    enum Path {
        PerPair,
        Grouped,
        Mma,
        // Hopper's wgmma (`moe_gu_wg` / `moe_down_wg`), or warp-specialised (`moe_*_wq`)
        Wg { ws: bool },
    }
    let n2 = MOST;
    assert!(m.grouped(n2) && !m.grouped(n));
    let mut x2 = rand_vec(&mut e.rng, n2 * h, -1.0, 1.0);
    for t in 1..37 {
        x2.copy_within(0..h, t * h);
    }
    let run = |path: Path| -> Vec<f32> {
        let xb = g.upload(&x2).unwrap();
        let (xn, ids, wts) = (
            poisoned(g, n2 * h),
            g.upload(&vec![-1i32; n2 * m.used]).unwrap(),
            poisoned(g, n2 * m.used),
        );
        let hb = poisoned(g, n2 * m.used * m.ffn);
        g.moe_route(abi::MoeRoute {
            x: xb.ptr,
            norm_w: nb.ptr,
            router: rb.ptr,
            xn: xn.ptr,
            ids: ids.ptr,
            wts: wts.ptr,
            counts: 0,
            logits: logits.ptr,
            ticket: ticket.ptr,
            ntok: n2 as i32,
        })
        .unwrap();
        if path == Path::PerPair {
            g.moe_gu(abi::MoeGu {
                xn: xn.ptr,
                wqs: gub.qs.ptr,
                wsc: gub.sc_ptr(),
                ids: ids.ptr,
                norm_w: 0,
                racc: 0,
                wts: 0,
                counts: 0,
                h: hb.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
            g.moe_down(abi::MoeDown {
                h: hb.ptr,
                wqs: dnb.qs.ptr,
                wsc: dnb.sc_ptr(),
                ids: ids.ptr,
                wts: wts.ptr,
                x: xb.ptr,
                racc: 0,
                ntok: n2 as i32,
            })
            .unwrap();
            return read_f32(g, &xb, n2 * h);
        }
        let offsets = g.upload(&vec![-1i32; m.experts + 1]).unwrap();
        let order = g.upload(&vec![-1i32; n2 * m.used]).unwrap();
        let y = poisoned(g, n2 * m.used * h);
        let tiles = g.upload(&vec![-1i32; 1 + 2 * m.tiles(n2)]).unwrap();
        g.moe_sort(abi::MoeSort {
            ids: ids.ptr,
            offsets: offsets.ptr,
            order: order.ptr,
            tiles: match path {
                Path::Mma | Path::Wg { .. } => tiles.ptr,
                _ => 0,
            },
            ntok: n2 as i32,
        })
        .unwrap();
        if let Path::Wg { ws } = path {
            // the tokens' normed rows in the GEMMs' 16-bit type; h in it too
            let a = g.upload(&vec![0xffffu16; n2 * h]).unwrap();
            g.wg_act_head(abi::WgActHead {
                x: xb.ptr,
                sel: 0,
                norm_w: nb.ptr,
                a: a.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
            let gu = abi::MoeGuWg {
                a: a.ptr,
                w: gub.qs.ptr,
                wsc: gub.sc_ptr(),
                offsets: offsets.ptr,
                order: order.ptr,
                tiles: tiles.ptr,
                h: hb.ptr,
                ntok: n2 as i32,
            };
            g.moe_gu_wg(gu, ws).unwrap();
            let dn = abi::MoeDownWg {
                a: hb.ptr,
                w: dnb.qs.ptr,
                wsc: dnb.sc_ptr(),
                offsets: offsets.ptr,
                order: order.ptr,
                tiles: tiles.ptr,
                y: y.ptr,
                ntok: n2 as i32,
            };
            g.moe_down_wg(dn, ws).unwrap();
        } else if path == Path::Grouped {
            g.moe_gu_grouped(abi::MoeGuGrouped {
                xn: xn.ptr,
                wqs: gub.qs.ptr,
                wsc: gub.sc_ptr(),
                offsets: offsets.ptr,
                order: order.ptr,
                h: hb.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
            g.moe_down_grouped(abi::MoeDownGrouped {
                h: hb.ptr,
                wqs: dnb.qs.ptr,
                wsc: dnb.sc_ptr(),
                offsets: offsets.ptr,
                order: order.ptr,
                y: y.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
        } else {
            let rows = (n2 * h).max(n2 * m.used * m.ffn);
            let (hi, lo, asx) = (
                g.upload(&vec![0xffffu16; rows]).unwrap(),
                g.upload(&vec![0xffffu16; rows]).unwrap(),
                poisoned(g, rows / 32),
            );
            g.moe_split_x(abi::MoeSplitX {
                x: xn.ptr,
                hi: hi.ptr,
                lo: lo.ptr,
                asx: asx.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
            g.moe_gu_mma(abi::MoeGuMma {
                ahi: hi.ptr,
                alo: lo.ptr,
                asx: asx.ptr,
                wqs: gub.qs.ptr,
                wsc: gub.sc_ptr(),
                offsets: offsets.ptr,
                order: order.ptr,
                tiles: tiles.ptr,
                h: hb.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
            g.moe_split_h(abi::MoeSplitH {
                x: hb.ptr,
                hi: hi.ptr,
                lo: lo.ptr,
                asx: asx.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
            g.moe_down_mma(abi::MoeDownMma {
                ahi: hi.ptr,
                alo: lo.ptr,
                asx: asx.ptr,
                wqs: dnb.qs.ptr,
                wsc: dnb.sc_ptr(),
                offsets: offsets.ptr,
                order: order.ptr,
                tiles: tiles.ptr,
                y: y.ptr,
                ntok: n2 as i32,
            })
            .unwrap();
        }
        g.moe_combine(abi::MoeCombine {
            y: y.ptr,
            wts: wts.ptr,
            x: xb.ptr,
            ntok: n2 as i32,
        })
        .unwrap();
        // the groups: every pair once, under the expert it was routed to
        let (mut off, mut ord, mut got_ids) = (
            vec![0i32; m.experts + 1],
            vec![0i32; n2 * m.used],
            vec![0i32; n2 * m.used],
        );
        g.read(&offsets, 0, &mut off).unwrap();
        g.read(&order, 0, &mut ord).unwrap();
        g.read(&ids, 0, &mut got_ids).unwrap();
        assert_eq!((off[0], off[m.experts]), (0, (n2 * m.used) as i32));
        let mut seen = vec![false; n2 * m.used];
        for ex in 0..m.experts {
            for &p in &ord[off[ex] as usize..off[ex + 1] as usize] {
                assert_eq!(
                    got_ids[p as usize], ex as i32,
                    "pair {p} grouped under expert {ex}"
                );
                assert!(
                    !std::mem::replace(&mut seen[p as usize], true),
                    "pair {p} twice"
                );
            }
        }
        assert!(
            off[got_ids[0] as usize + 1] - off[got_ids[0] as usize] >= 37,
            "token 0's experts take its 37 copies"
        );
        if path != Path::PerPair && path != Path::Grouped {
            // the work list: each expert's pairs in tiles of GEMM_BM, in expert order
            let mut tl = vec![0i32; 1 + 2 * m.tiles(n2)];
            g.read(&tiles, 0, &mut tl).unwrap();
            let bm = abi::GEMM_BM as i32;
            let want: Vec<(i32, i32)> = (0..m.experts)
                .flat_map(|ex| {
                    let n = off[ex + 1] - off[ex];
                    (0..n).step_by(bm as usize).map(move |m0| (ex as i32, m0))
                })
                .collect();
            let got: Vec<(i32, i32)> = (0..tl[0] as usize)
                .map(|i| (tl[1 + 2 * i], tl[2 + 2 * i]))
                .collect();
            assert_eq!(got, want, "moe_sort's tiles");
            assert!(
                got.iter().any(|&(_, m0)| m0 == bm),
                "an expert with two tiles"
            );
        }
        read_f32(g, &xb, n2 * h)
    };
    let per_pair = run(Path::PerPair);
    let grouped = run(Path::Grouped);
    let mma = run(Path::Mma);
    let mut tk = vec![1u32; n2];
    g.read(&ticket, 0, &mut tk).unwrap();
    assert!(tk.iter().all(|&v| v == 0), "moe_route re-arms its tickets");
    // the same per-token sums in the same order: expected bit for bit; held to TOL like the CPU
    let same = per_pair
        .iter()
        .zip(&grouped)
        .filter(|(a, b)| a.to_bits() == b.to_bits())
        .count();
    check(
        "moe grouped against the per-pair kernels",
        &grouped,
        &per_pair,
    );
    let want2: Vec<f32> = x2
        .chunks_exact(h)
        .flat_map(|row| reference(row).1)
        .collect();
    check_tol(
        "moe grouped: x + sum of the routed experts' outputs",
        &grouped,
        &want2,
        mv_tol,
    );
    check(
        "moe on the tensor cores: x + sum of the routed experts' outputs",
        &mma,
        &want2,
    );
    eprintln!(
        "  moe grouped: {n2} tokens, {same} of {} values bit-identical to the per-pair kernels",
        n2 * h
    );
    // on Hopper's wgmma (the dense products' kernels and numerics: HOPPER_TOL), the
    // one-warpgroup kernels and, with quantized weights, the warp-specialised ones
    if g.moe_wg {
        let mut paths = vec![false];
        if !g.weights_bf16() {
            paths.push(true);
        }
        // the experts' part alone (x's own values would hide a wrong row's few percent)
        let part = |v: &[f32]| -> Vec<f32> { v.iter().zip(&x2).map(|(a, b)| a - b).collect() };
        let want_part = part(&want2);
        for ws in paths {
            let got = part(&run(Path::Wg { ws }));
            check_tol(
                &format!("moe on wgmma (warp-specialised: {ws}): the routed experts' outputs"),
                &got,
                &want_part,
                HOPPER_TOL,
            );
            // and token by token: every row within the bound, not only their sum
            let worst = got
                .chunks_exact(h)
                .zip(want_part.chunks_exact(h))
                .map(|(a, b)| rel_err(a, b))
                .fold(0f64, f64::max);
            eprintln!("  moe on wgmma (warp-specialised: {ws}): worst token {worst:.2e}");
            assert!(
                worst < HOPPER_TOL,
                "moe on wgmma: a token's outputs off by {worst:.3e}"
            );
        }
    } else {
        eprintln!("  moe on wgmma: skipped: the GEMM path does not run on Hopper here");
    }

    // A prompt chunk's routing: 1,030 tokens in one launch (tiles of abi::MOE_ROUTE_TOKENS, one
    // block each, the last tile part-full) against the same tokens five at a time (their router
    // rows spread over blocks that meet through the tickets, the path checked against the CPU
    // above). Each logit sums the same products in the same order whatever the tile and the
    // split, so xn, the experts and their weights must agree bit for bit.
    let nm: usize = 1030;
    assert_eq!(
        g.moe_router_blocks(nm.div_ceil(abi::MOE_ROUTE_TOKENS as usize)),
        1,
        "a 1,030-token chunk takes a block a tile"
    );
    assert!(
        g.moe_router_blocks(2) > 1,
        "5 tokens (two tiles) spread their router rows"
    );
    let xm = rand_vec(&mut e.rng, nm * h, -1.0, 1.0);
    let xmb = g.upload(&xm).unwrap();
    let route_into = |off: usize, count: usize, out: (&DevBuf, &DevBuf, &DevBuf)| {
        let (lg, tk) = (
            poisoned(g, count * m.experts),
            g.upload(&vec![0u32; count]).unwrap(),
        );
        g.moe_route(abi::MoeRoute {
            x: xmb.ptr + (off * h * 4) as u64,
            norm_w: nb.ptr,
            router: rb.ptr,
            xn: out.0.ptr + (off * h * 4) as u64,
            ids: out.1.ptr + (off * m.used * 4) as u64,
            wts: out.2.ptr + (off * m.used * 4) as u64,
            counts: 0,
            logits: lg.ptr,
            ticket: tk.ptr,
            ntok: count as i32,
        })
        .unwrap();
    };
    let outs = || {
        (
            poisoned(g, nm * h),
            g.upload(&vec![-1i32; nm * m.used]).unwrap(),
            poisoned(g, nm * m.used),
        )
    };
    let (one, fives) = (outs(), outs());
    route_into(0, nm, (&one.0, &one.1, &one.2));
    for off in (0..nm).step_by(5) {
        route_into(off, 5.min(nm - off), (&fives.0, &fives.1, &fives.2));
    }
    let bits = |b: &DevBuf, n: usize| -> Vec<u32> {
        let mut v = vec![0u32; n];
        g.read(b, 0, &mut v).unwrap();
        v
    };
    assert!(
        bits(&one.0, nm * h) == bits(&fives.0, nm * h),
        "xn of a 1,030-token launch differs from 5-token launches"
    );
    assert!(
        bits(&one.1, nm * m.used) == bits(&fives.1, nm * m.used),
        "the experts of a 1,030-token launch differ from 5-token launches"
    );
    assert!(
        bits(&one.2, nm * m.used) == bits(&fives.2, nm * m.used),
        "the weights of a 1,030-token launch differ from 5-token launches"
    );
    eprintln!("  moe_route: {nm} tokens in one launch bit-identical to 5-token launches (xn, experts, weights)");
}
