//! The device layer of the CUDA backend: the CUDA context and stream, device buffers addressed by
//! raw pointers, the kernel modules of one target (cubin first, PTX as fallback) and one launch
//! function per kernel entry point. The only place in the crate that calls the driver.
//!
//! Invariants:
//! - One context, one non-default stream (graphs capture it); cudarc's per-buffer event tracking is
//!   off, so every ordering is the stream's program order.
//! - Every kernel is launched with the grid and block its template's header comment states, computed
//!   by `plan`; the shape constants come from the target the blobs were built for.
//! - A device whose compute capability differs from the blobs' cubin arch is refused before any
//!   module is loaded.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use std::ffi::c_void;

use cudarc::driver::{
    result as dres, sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
};
use metrale_core::BackendError;

use super::plan;

/// The kernel templates a CUDA target compiles (kernels/cuda/README.md); `gemm` holds the
/// tensor-core prefill kernels (launched by `super::gemm`), `decode` the persistent batch-1 decode
/// step (`super::decode`).
pub const TEMPLATES: [&str; 10] = [
    "embed",
    "attn_in",
    "attention",
    "attn_out",
    "ffn_in",
    "ffn_out",
    "lm_head",
    "sample",
    "gemm",
    "decode",
];

/// Every (template, entry point) pair the backend launches.
pub const KERNELS: [(&str, &str); 11] = [
    ("embed", "embed"),
    ("attn_in", "attn_in"),
    ("attention", "attention"),
    ("attn_out", "attn_out"),
    ("ffn_in", "ffn_in"),
    ("ffn_out", "ffn_out"),
    ("lm_head", "lm_head"),
    ("lm_head", "lm_head_1"),
    ("sample", "argmax_logprob"),
    ("sample", "sample_probs"),
    ("decode", "decode_1"),
];

/// Per-row parameters of `sample_probs` (`SampleParams` in sample.cu.hbs; 32 bytes, C layout).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: i32,
    pub seed: u64,
    pub draw: u64,
}

/// One compiled kernel: cubin for the exact arch, PTX as fallback.
#[derive(Debug, Clone)]
pub struct KernelBlob {
    pub name: String,
    pub cubin: Vec<u8>,
    pub ptx: Option<Vec<u8>>,
}

/// The compiled kernels of one target.
#[derive(Debug, Clone)]
pub struct KernelSet {
    /// "hw/model/quant"
    pub target: String,
    /// Cubin arch, e.g. "sm_90a".
    pub arch: String,
    pub blobs: BTreeMap<String, KernelBlob>,
}

fn dev_err(
    what: impl std::fmt::Display,
) -> impl FnOnce(cudarc::driver::DriverError) -> BackendError {
    let what = what.to_string();
    move |e| BackendError::Device(format!("{what}: {e}"))
}

impl KernelSet {
    /// Read `<dir>/<name>.cubin` (and `<name>.ptx` when present) for every kernel in [`KERNELS`].
    pub fn from_dir(dir: &Path, target: &str, arch: &str) -> Result<KernelSet, BackendError> {
        let mut blobs = BTreeMap::new();
        for name in TEMPLATES {
            let cp = dir.join(format!("{name}.cubin"));
            let cubin = std::fs::read(&cp).map_err(|e| {
                BackendError::Device(format!(
                    "kernel {name}: cannot read {}: {e}; build the target's kernels first (cargo xtask build-target ... --kernels-only)",
                    cp.display()
                ))
            })?;
            let ptx = std::fs::read(dir.join(format!("{name}.ptx"))).ok();
            blobs.insert(
                name.to_string(),
                KernelBlob {
                    name: name.to_string(),
                    cubin,
                    ptx,
                },
            );
        }
        Ok(KernelSet {
            target: target.into(),
            arch: arch.into(),
            blobs,
        })
    }
}

impl KernelSet {
    /// The kernels embedded in this binary (`metrale_kernels::registry()`), after checking every
    /// blob's sha256 against the embedded attestation. Also returns the target they were built for.
    pub fn from_registry(
        reg: &metrale_kernels::Registry,
    ) -> Result<(KernelSet, metrale_core::target::TargetSpec), BackendError> {
        reg.verify()
            .map_err(|e| BackendError::Device(format!("embedded kernels refused: {e}")))?;
        let spec = reg.target.clone().ok_or_else(|| {
            BackendError::Device("this binary embeds no kernels (a generic build): build it with `cargo xtask build-target --hw <gpu> ...`".into())
        })?;
        let target = format!("{}/{}/{}", spec.id.hw, spec.id.model, spec.id.quant);
        let arch = spec.hardware.cubin_arch.clone().ok_or_else(|| {
            BackendError::Device(format!(
                "target {target} is not a CUDA target (no cubin arch)"
            ))
        })?;
        let mut blobs = BTreeMap::new();
        for name in TEMPLATES {
            let k = reg.kernel(name).ok_or_else(|| {
                BackendError::Device(format!(
                    "target {target}: the binary embeds no kernel {name}"
                ))
            })?;
            let ptx = if k.ptx.is_empty() {
                None
            } else {
                Some(k.ptx.as_bytes().to_vec())
            };
            blobs.insert(
                name.to_string(),
                KernelBlob {
                    name: name.to_string(),
                    cubin: k.cubin.to_vec(),
                    ptx,
                },
            );
        }
        Ok((
            KernelSet {
                target,
                arch,
                blobs,
            },
            spec,
        ))
    }
}

/// A device allocation addressed by its raw pointer (kept alive by the slice).
pub struct DevBuf {
    _slice: CudaSlice<u8>,
    pub ptr: u64,
    pub bytes: usize,
}

/// The loaded kernel functions.
struct Funcs {
    embed: CudaFunction,
    attn_in: CudaFunction,
    attention: CudaFunction,
    attn_out: CudaFunction,
    ffn_in: CudaFunction,
    ffn_out: CudaFunction,
    lm_head: CudaFunction,
    lm_head_1: CudaFunction,
    argmax: CudaFunction,
    sample: CudaFunction,
    decode_1: CudaFunction,
    modules: BTreeMap<&'static str, Arc<CudaModule>>,
}

/// Shape constants the kernels were compiled with (from the target's MODEL.toml).
pub use crate::shape::Dims;

/// The CUDA context, stream and kernels of one target.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub sm_count: usize,
    pub dims: Dims,
    pub device_name: String,
    pub cc: (i32, i32),
    f: Funcs,
    /// "cubin" or "ptx": how the modules were loaded
    pub loaded_from: &'static str,
    /// Launch with programmatic dependent launch (sm_90+; `METRALE_CUDA_PDL=0` turns it off).
    pub pdl: bool,
    /// Resident blocks of `lm_head_1` per SM (the driver's occupancy for its registers).
    pub lm1_per_sm: usize,
    /// Most attention splits launched as one thread-block cluster (sm_90+; 0 or 1: none). Default
    /// [`plan::ATT_CLUSTER_DEFAULT`]; `METRALE_CUDA_CLUSTER=N` sets it (0 turns clusters off; at
    /// most [`plan::ATT_MAX_CLUSTER`]).
    pub cluster_max: usize,
}

/// Page-locked host words filled by `Gpu::read_staged`, and the event that marks the copy's end.
pub struct HostStage {
    buf: cudarc::driver::PinnedHostSlice<u32>,
    ev: cudarc::driver::CudaEvent,
}

impl HostStage {
    /// Wait for the last `Gpu::read_staged` into this area (not for anything enqueued after it).
    pub fn wait(&self) -> Result<&[u32], BackendError> {
        self.ev
            .synchronize()
            .map_err(dev_err("wait for a copy from the device (a kernel failed)"))?;
        self.buf
            .as_slice()
            .map_err(dev_err("page-locked host memory"))
    }
}

/// How a kernel is launched besides its grid: programmatic dependent launch, a thread-block cluster
/// along y, a cooperative grid (all blocks co-resident), dynamic shared memory bytes.
#[derive(Debug, Clone, Copy)]
struct LaunchHow {
    pdl: bool,
    cluster_y: u32,
    cooperative: bool,
    smem: u32,
}

/// Kernel argument list: pointers to the argument values (which must outlive the launch call).
macro_rules! kargs {
    ($($a:expr),* $(,)?) => { [$( &$a as *const _ as *mut c_void ),*] };
}

/// Device count, or 0 when no driver is present (for tests that skip without a GPU).
pub fn device_count() -> usize {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n as usize).unwrap_or(0))
        .unwrap_or(0)
}

impl Gpu {
    /// Open device `ordinal`, check its arch against the kernels', and load every module.
    pub fn open(ordinal: usize, set: &KernelSet, dims: Dims) -> Result<Gpu, BackendError> {
        if device_count() == 0 {
            return Err(BackendError::Device(format!(
                "no CUDA device found (driver library not loadable or no GPU); this binary's kernels are built for {} ({})",
                set.arch, set.target
            )));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(dev_err(format!("open CUDA device {ordinal}")))?;
        // One stream and program order: no per-buffer events (they would also break graph capture).
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx
            .compute_capability()
            .map_err(dev_err("compute capability"))?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown".into());
        plan::check_arch(&set.arch, &set.target, ordinal, cc, &device_name)
            .map_err(BackendError::Device)?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err("SM count"))? as usize;
        let stream = ctx.new_stream().map_err(dev_err("create stream"))?;
        let mut modules: BTreeMap<&str, Arc<CudaModule>> = BTreeMap::new();
        let mut funcs: BTreeMap<&str, CudaFunction> = BTreeMap::new();
        let mut loaded_from = "cubin";
        for name in TEMPLATES {
            let blob = set.blobs.get(name).ok_or_else(|| {
                BackendError::Device(format!(
                    "kernel set {}: kernel {name} is missing",
                    set.target
                ))
            })?;
            let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(blob.cubin.clone()))
            {
                Ok(m) => m,
                Err(e_cubin) => match &blob.ptx {
                    Some(ptx) => {
                        loaded_from = "ptx";
                        let mut p = ptx.clone();
                        p.push(0);
                        ctx.load_module(cudarc::nvrtc::Ptx::from_binary(p)).map_err(|e| {
                            BackendError::Device(format!("kernel {name}: cubin refused ({e_cubin}) and PTX refused ({e})"))
                        })?
                    }
                    None => {
                        return Err(BackendError::Device(format!(
                            "kernel {name}: cubin refused by the driver: {e_cubin}"
                        )))
                    }
                },
            };
            modules.insert(name, module);
        }
        for (name, entry) in KERNELS {
            let f = modules[name].load_function(entry).map_err(dev_err(format!(
                "kernel {name}: entry point {entry} not found"
            )))?;
            funcs.insert(entry, f);
        }
        let mut take = |n: &str| funcs.remove(n).expect("every kernel was loaded above");
        let f = Funcs {
            embed: take("embed"),
            attn_in: take("attn_in"),
            attention: take("attention"),
            attn_out: take("attn_out"),
            ffn_in: take("ffn_in"),
            ffn_out: take("ffn_out"),
            lm_head: take("lm_head"),
            lm_head_1: take("lm_head_1"),
            argmax: take("argmax_logprob"),
            sample: take("sample_probs"),
            decode_1: take("decode_1"),
            modules,
        };
        let pdl = cc.0 >= 9
            && std::env::var("METRALE_CUDA_PDL")
                .map(|v| v != "0")
                .unwrap_or(true);
        let lm1_per_sm = f
            .lm_head_1
            .occupancy_max_active_blocks_per_multiprocessor(plan::MV_THREADS, 0, None)
            .map(|n| n as usize)
            .unwrap_or(2)
            .max(1);
        let cluster_max = if cc.0 >= 9 {
            std::env::var("METRALE_CUDA_CLUSTER")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(plan::ATT_CLUSTER_DEFAULT)
                .min(plan::ATT_MAX_CLUSTER)
        } else {
            0
        };
        Ok(Gpu {
            ctx,
            stream,
            sm_count,
            dims,
            device_name,
            cc,
            f,
            loaded_from,
            pdl,
            lm1_per_sm,
            cluster_max,
        })
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> (usize, usize) {
        self.ctx.mem_get_info().unwrap_or((0, 0))
    }

    /// Allocate `bytes` (zeroed).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, BackendError> {
        let slice = self.stream.alloc_zeros::<u8>(bytes.max(16)).map_err(|e| {
            let (free, _) = self.mem_info();
            BackendError::OutOfMemory {
                device: self.device_name.clone(),
                needed: bytes as u64,
                free: free as u64,
                hint: format!("cuMemAlloc failed ({e}); use fewer slots or a smaller context"),
            }
        })?;
        let ptr = {
            let (p, _sync) = slice.device_ptr(&self.stream);
            p
        };
        Ok(DevBuf {
            _slice: slice,
            ptr,
            bytes,
        })
    }

    /// Allocate and fill from `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf, BackendError> {
        let bytes = std::mem::size_of_val(data);
        let b = self.alloc(bytes)?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// Copy `data` to `buf` at byte offset `off` (waits for the copy).
    pub fn write<T: Copy>(&self, buf: &DevBuf, off: usize, data: &[T]) -> Result<(), BackendError> {
        if std::mem::size_of_val(data) == 0 {
            return self.write_async(buf, off, data); // bounds check only: nothing to wait for
        }
        self.write_async(buf, off, data)?;
        self.sync()
    }

    /// Copy `data` to `buf` at byte offset `off` in stream order without waiting: the driver stages
    /// pageable memory before returning, so `data` may be reused at once.
    pub fn write_async<T: Copy>(
        &self,
        buf: &DevBuf,
        off: usize,
        data: &[T],
    ) -> Result<(), BackendError> {
        let bytes = std::mem::size_of_val(data);
        if off + bytes > buf.bytes {
            return Err(BackendError::Device(format!(
                "write of {bytes} bytes at {off} past a buffer of {}",
                buf.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        unsafe { dres::memcpy_htod_async(buf.ptr + off as u64, data, self.stream.cu_stream()) }
            .map_err(dev_err("copy to device"))
    }

    /// Read `out.len()` elements from `buf` at byte offset `off` (waits for the stream first).
    pub fn read<T: Copy>(
        &self,
        buf: &DevBuf,
        off: usize,
        out: &mut [T],
    ) -> Result<(), BackendError> {
        let bytes = std::mem::size_of_val(out);
        if off + bytes > buf.bytes {
            return Err(BackendError::Device(format!(
                "read of {bytes} bytes at {off} past a buffer of {}",
                buf.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        unsafe { dres::memcpy_dtoh_async(out, buf.ptr + off as u64, self.stream.cu_stream()) }
            .map_err(dev_err("copy from device"))?;
        self.sync()
    }

    pub fn sync(&self) -> Result<(), BackendError> {
        self.stream
            .synchronize()
            .map_err(dev_err("stream synchronize (a kernel failed)"))
    }

    /// Entry point `entry` of the loaded template `template` (kernels launched outside this file).
    pub fn function(&self, template: &str, entry: &str) -> Result<CudaFunction, BackendError> {
        let m = self
            .f
            .modules
            .get(template)
            .ok_or_else(|| BackendError::Device(format!("kernel {template} is not loaded")))?;
        m.load_function(entry).map_err(dev_err(format!(
            "kernel {template}: entry point {entry} not found"
        )))
    }

    /// Launch `f` on the stream (with the PDL attribute when enabled).
    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        what: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), BackendError> {
        self.launch_cluster(f, what, grid, block, 1, args)
    }

    /// Launch `f` as [`Gpu::launch`] does, grouped into thread-block clusters of `cluster_y` blocks
    /// along y when `cluster_y > 1` (sm_90+ only; the caller checks [`Gpu::cluster_max`]).
    fn launch_cluster(
        &self,
        f: &CudaFunction,
        what: &str,
        grid: (u32, u32, u32),
        block: u32,
        cluster_y: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), BackendError> {
        let how = LaunchHow {
            pdl: self.pdl,
            cluster_y,
            cooperative: false,
            smem: 0,
        };
        self.launch_how(f, what, grid, block, how, args)
    }

    /// The one call of `cuLaunchKernelEx`: `f` on the stream with the attributes `how` asks for.
    fn launch_how(
        &self,
        f: &CudaFunction,
        what: &str,
        grid: (u32, u32, u32),
        block: u32,
        how: LaunchHow,
        args: &mut [*mut c_void],
    ) -> Result<(), BackendError> {
        // SAFETY: zeroed attributes are valid plain data; we set each id and its matching union field.
        let mut attrs: [sys::CUlaunchAttribute; 3] = unsafe { std::mem::zeroed() };
        let mut n = 0usize;
        if how.pdl {
            attrs[n].id = sys::CUlaunchAttributeID_enum::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if how.cluster_y > 1 {
            attrs[n].id = sys::CUlaunchAttributeID_enum::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                x: 1,
                y: how.cluster_y,
                z: 1,
            };
            n += 1;
        }
        if how.cooperative {
            attrs[n].id = sys::CUlaunchAttributeID_enum::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: how.smem,
            hStream: self.stream.cu_stream(),
            attrs: if n > 0 {
                attrs.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            numAttrs: n as u32,
        };
        self.ctx.bind_to_thread().map_err(dev_err("bind context"))?;
        // SAFETY: `args` points to live values whose types match the kernel's parameters (each
        // launcher below mirrors its template's signature).
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(dev_err(format!("launch {what}")))
    }

    fn mv_grid(&self, row_pairs: usize, k: usize, ntok: usize) -> (u32, u32, u32) {
        plan::mv_grid(row_pairs, k, ntok, self.sm_count)
    }

    /// embed(table_qs, table_sc, tokens, x, ntok)
    pub fn embed(
        &self,
        table: &DevMat,
        tokens: u64,
        x: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let (qs, sc, n) = (table.qs.ptr, table.sc_ptr(), ntok as i32);
        self.launch(
            &self.f.embed,
            "embed",
            (ntok as u32, 1, 1),
            plan::EMBED_THREADS,
            &mut kargs!(qs, sc, tokens, x, n),
        )
    }

    /// attn_in(x, norm, wqkv_qs, wqkv_sc, rope, q, kc, vc, pos, slot, layer, ctx, ntok)
    #[allow(clippy::too_many_arguments)]
    pub fn attn_in(
        &self,
        x: u64,
        norm: u64,
        w: &DevMat,
        rope: u64,
        q: u64,
        kc: u64,
        vc: u64,
        pos: u64,
        slot: u64,
        layer: usize,
        ctx: usize,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let d = self.dims;
        let grid = self.mv_grid((d.qd() + 2 * d.kd()) / 2, d.hidden, ntok);
        let (qs, sc, l, c, n) = (w.qs.ptr, w.sc_ptr(), layer as i32, ctx as i32, ntok as i32);
        self.launch(
            &self.f.attn_in,
            "attn_in",
            grid,
            plan::MV_THREADS,
            &mut kargs!(x, norm, qs, sc, rope, q, kc, vc, pos, slot, l, c, n),
        )
    }

    /// attention(q, kc, vc, pos, slot, layer, ctx, nsplit, part_ml, part_acc, counter, out):
    /// `counter` holds `ntok * kv_heads` zeroed u32 tickets; `out` receives `[ntok][qd]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        pos: u64,
        slot: u64,
        layer: usize,
        ctx: usize,
        nsplit: usize,
        part_ml: u64,
        part_acc: u64,
        counter: u64,
        out: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let grid = (self.dims.kv_heads as u32, nsplit as u32, ntok as u32);
        let (l, c, s) = (layer as i32, ctx as i32, nsplit as i32);
        // the splits of one (KV head, token) as one cluster: combined through distributed shared memory
        let cluster = if nsplit > 1 && nsplit <= self.cluster_max {
            nsplit as u32
        } else {
            1
        };
        self.launch_cluster(
            &self.f.attention,
            "attention",
            grid,
            plan::ATT_THREADS,
            cluster,
            &mut kargs!(q, kc, vc, pos, slot, l, c, s, part_ml, part_acc, counter, out),
        )
    }

    /// attn_out(att, wo_qs, wo_sc, x, ntok)
    pub fn attn_out(&self, att: u64, w: &DevMat, x: u64, ntok: usize) -> Result<(), BackendError> {
        let d = self.dims;
        let grid = self.mv_grid(d.hidden / 2, d.qd(), ntok);
        let (qs, sc, n) = (w.qs.ptr, w.sc_ptr(), ntok as i32);
        self.launch(
            &self.f.attn_out,
            "attn_out",
            grid,
            plan::MV_THREADS,
            &mut kargs!(att, qs, sc, x, n),
        )
    }

    /// ffn_in(x, norm, wgu_qs, wgu_sc, h, ntok)
    pub fn ffn_in(
        &self,
        x: u64,
        norm: u64,
        w: &DevMat,
        h: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let d = self.dims;
        let grid = self.mv_grid(d.ffn, d.hidden, ntok);
        let (qs, sc, n) = (w.qs.ptr, w.sc_ptr(), ntok as i32);
        self.launch(
            &self.f.ffn_in,
            "ffn_in",
            grid,
            plan::MV_THREADS,
            &mut kargs!(x, norm, qs, sc, h, n),
        )
    }

    /// ffn_out(h, wdown_qs, wdown_sc, x, ntok)
    pub fn ffn_out(&self, h: u64, w: &DevMat, x: u64, ntok: usize) -> Result<(), BackendError> {
        let d = self.dims;
        let grid = self.mv_grid(d.hidden / 2, d.ffn, ntok);
        let (qs, sc, n) = (w.qs.ptr, w.sc_ptr(), ntok as i32);
        self.launch(
            &self.f.ffn_out,
            "ffn_out",
            grid,
            plan::MV_THREADS,
            &mut kargs!(h, qs, sc, x, n),
        )
    }

    /// lm_head(x, sel, norm, wout_qs, wout_sc, logits, nout, part, counter, out_tok, out_logprob):
    /// logits of each selected row plus the fused greedy choice (`lm_head_1` for one output, the
    /// batch-1 decode path). `part` and `counter` are sized by [`Gpu::lm_head_scratch`]; the
    /// counters are zero between launches.
    #[allow(clippy::too_many_arguments)]
    pub fn lm_head(
        &self,
        x: u64,
        sel: u64,
        norm: u64,
        w: &DevMat,
        logits: u64,
        nout: usize,
        part: u64,
        counter: u64,
        out_tok: u64,
        out_lp: u64,
    ) -> Result<(), BackendError> {
        let (qs, sc, n) = (w.qs.ptr, w.sc_ptr(), nout as i32);
        if nout == 1 {
            let grid = (
                plan::lm_head1_blocks(self.dims.vocab, self.sm_count, self.lm1_per_sm),
                1,
                1,
            );
            return self.launch(
                &self.f.lm_head_1,
                "lm_head_1",
                grid,
                plan::MV_THREADS,
                &mut kargs!(x, sel, norm, qs, sc, logits, n, part, counter, out_tok, out_lp),
            );
        }
        let d = self.dims;
        let grid = self.mv_grid(d.vocab / 2, d.hidden, nout);
        self.launch(
            &self.f.lm_head,
            "lm_head",
            grid,
            plan::MV_THREADS,
            &mut kargs!(x, sel, norm, qs, sc, logits, n, part, counter, out_tok, out_lp),
        )
    }

    /// Bytes of the `part` buffer `lm_head` needs for up to `nout` outputs (12-byte partials), and of
    /// its counters (one u32 per token tile).
    pub fn lm_head_scratch(&self, nout: usize) -> (usize, usize) {
        let d = self.dims;
        let (gx, gy, _) = self.mv_grid(d.vocab / 2, d.hidden, nout);
        let gx = (gx as usize)
            .max(plan::lm_head1_blocks(d.vocab, self.sm_count, self.lm1_per_sm) as usize);
        (nout.max(1) * gx * 12, gy.max(1) as usize * 4)
    }

    /// argmax_logprob(logits, out_tok, out_logprob, nout)
    pub fn argmax(
        &self,
        logits: u64,
        out_tok: u64,
        out_lp: u64,
        nout: usize,
    ) -> Result<(), BackendError> {
        let n = nout as i32;
        self.launch(
            &self.f.argmax,
            "argmax_logprob",
            (nout as u32, 1, 1),
            plan::SAMPLE_THREADS,
            &mut kargs!(logits, out_tok, out_lp, n),
        )
    }

    /// sample_probs(logits, params, out_tok, out_logprob, status, nout)
    pub fn sample_probs(
        &self,
        logits: u64,
        params: u64,
        out_tok: u64,
        out_lp: u64,
        status: u64,
        nout: usize,
    ) -> Result<(), BackendError> {
        let n = nout as i32;
        self.launch(
            &self.f.sample,
            "sample_probs",
            (nout as u32, 1, 1),
            plan::SAMPLE_THREADS,
            &mut kargs!(logits, params, out_tok, out_lp, status, n),
        )
    }

    /// Get `decode_1` ready for `smem` bytes of dynamic shared memory per block of `threads`: its
    /// resident blocks per SM and (registers, local bytes) per thread; `None` when the device cannot
    /// give a block that much shared memory.
    pub fn decode1_prepare(
        &self,
        threads: u32,
        smem: usize,
    ) -> Result<Option<(u32, (i32, i32))>, BackendError> {
        use sys::CUfunction_attribute_enum as A;
        let f = &self.f.decode_1;
        if f.set_attribute(
            A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .is_err()
        {
            return Ok(None);
        }
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
            .map_err(dev_err("decode_1 occupancy"))?;
        let regs = f.get_attribute(A::CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap_or(-1);
        let local = f
            .get_attribute(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
            .unwrap_or(-1);
        Ok(Some((per_sm, (regs, local))))
    }

    /// Launch `decode_1` (kernels/cuda/decode.cu.hbs) as a cooperative grid of `blocks` blocks (all
    /// co-resident, or the launch fails).
    pub fn decode_1(
        &self,
        blocks: u32,
        threads: u32,
        smem: u32,
        a: &super::decode::KArgs,
    ) -> Result<(), BackendError> {
        let mut args = kargs!(
            a.layers, a.emb_qs, a.emb_sc, a.head_qs, a.head_sc, a.out_norm, a.rope, a.kc, a.vc,
            a.token, a.pos, a.slot, a.ctx, a.epoch, a.flags, a.att_cfg, a.xch, a.logits, a.part,
            a.counter, a.out_tok, a.out_lp, a.trace
        );
        let how = LaunchHow {
            pdl: false,
            cluster_y: 1,
            cooperative: true,
            smem,
        };
        self.launch_how(
            &self.f.decode_1,
            "decode_1",
            (blocks, 1, 1),
            threads,
            how,
            &mut args,
        )
    }

    /// A page-locked host area of `words` u32 words for `read_staged` (copies into pageable memory
    /// would make the host wait for the stream).
    pub fn host_stage(&self, words: usize) -> Result<HostStage, BackendError> {
        // flags 0: cached host memory (write-combined memory is slow for the host to read)
        let buf = unsafe { self.ctx.alloc_pinned_with_flags::<u32>(words.max(1), 0) }
            .map_err(dev_err("allocate page-locked host memory"))?;
        let ev = self.ctx.new_event(None).map_err(dev_err("create event"))?;
        Ok(HostStage { buf, ev })
    }

    /// Enqueue a copy of `stage`'s words from the start of `src` into `stage` and mark its end,
    /// without waiting: later launches may follow at once, and `HostStage::wait` returns the words
    /// as they were at this point of the stream.
    pub fn read_staged(&self, src: &DevBuf, stage: &mut HostStage) -> Result<(), BackendError> {
        let n = stage.buf.len().min(src.bytes / 4);
        let host = stage
            .buf
            .as_mut_slice()
            .map_err(dev_err("page-locked host memory"))?;
        unsafe { dres::memcpy_dtoh_async(&mut host[..n], src.ptr, self.stream.cu_stream()) }
            .map_err(dev_err("copy from device"))?;
        stage
            .ev
            .record(&self.stream)
            .map_err(dev_err("record event"))
    }

    /// Zero `buf` in stream order.
    pub fn zero_async(&self, buf: &DevBuf) -> Result<(), BackendError> {
        unsafe { dres::memset_d8_async(buf.ptr, 0, buf.bytes, self.stream.cu_stream()) }
            .map_err(dev_err("memset"))
    }

    /// Start capturing this stream's launches into a graph.
    pub fn begin_capture(&self) -> Result<(), BackendError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(dev_err("begin graph capture"))
    }

    /// End the capture and instantiate the graph.
    pub fn end_capture(&self) -> Result<cudarc::driver::CudaGraph, BackendError> {
        self.stream
            .end_capture(sys::CUgraphInstantiate_flags_enum(0))
            .map_err(dev_err("end graph capture"))?
            .ok_or_else(|| BackendError::Device("graph capture produced no graph".into()))
    }
}

/// A weight matrix on the device (layout of `plan::HostMat`).
pub struct DevMat {
    pub qs: DevBuf,
    pub sc: Option<DevBuf>,
    pub rows: usize,
    pub k: usize,
}

impl DevMat {
    pub fn upload(gpu: &Gpu, m: &plan::HostMat) -> Result<DevMat, BackendError> {
        let qs = gpu.upload(&m.qs)?;
        let sc = if m.sc.is_empty() {
            None
        } else {
            Some(gpu.upload(&m.sc)?)
        };
        Ok(DevMat {
            qs,
            sc,
            rows: m.rows,
            k: m.k,
        })
    }
    pub fn sc_ptr(&self) -> u64 {
        self.sc.as_ref().map(|b| b.ptr).unwrap_or(0)
    }
    pub fn bytes(&self) -> usize {
        self.qs.bytes + self.sc.as_ref().map(|b| b.bytes).unwrap_or(0)
    }
}
