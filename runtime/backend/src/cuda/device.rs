//! The device layer of the CUDA backend: one CUDA context and stream, device memory addressed by raw
//! pointers, copies (synchronous, in stream order, and staged through page-locked memory), graph
//! capture, and the one call of `cuLaunchKernelEx` with its launch attributes. It knows no kernel,
//! no model and no target: the layers above it do.
//!
//! Invariants:
//! - One context, one non-default stream (graphs capture it); cudarc's per-buffer event tracking is
//!   off, so every ordering is the stream's program order.
//! - Every copy is bounds-checked against its buffer before it is enqueued.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{
    result as dres, sys, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr,
};
use metrale_core::BackendError;

/// A device allocation addressed by its raw pointer (kept alive by the slice).
pub struct DevBuf {
    _slice: CudaSlice<u8>,
    pub ptr: u64,
    pub bytes: usize,
}

/// Page-locked host words filled by [`Device::read_staged`], and the event that marks the copy's end.
pub struct HostStage {
    buf: cudarc::driver::PinnedHostSlice<u32>,
    ev: cudarc::driver::CudaEvent,
}

impl HostStage {
    /// Wait for the last [`Device::read_staged`] into this area (not for anything enqueued after it).
    pub fn wait(&self) -> Result<&[u32], BackendError> {
        self.ev
            .synchronize()
            .map_err(dev_err("wait for a copy from the device (a kernel failed)"))?;
        self.buf
            .as_slice()
            .map_err(dev_err("page-locked host memory"))
    }
}

/// Page-locked host words the device reads: staged copies ([`Device::write_staged`]; a copy from
/// pageable memory may make the host wait for every launch before it in the stream, one from here
/// does not), or, when mapped, kernels read them where they are ([`HostWrite::device_ptr`]).
/// Whoever refills it must first have waited for a point of the stream after the last copy or
/// kernel that read it.
pub struct HostWrite {
    buf: cudarc::driver::PinnedHostSlice<u32>,
    dev: Option<u64>,
}

impl HostWrite {
    /// The words, to fill before [`Device::write_staged`] or a kernel that reads them.
    pub fn words(&mut self) -> Result<&mut [u32], BackendError> {
        self.buf
            .as_mut_slice()
            .map_err(dev_err("page-locked host memory"))
    }

    /// The words' address for kernels, when mapped.
    pub fn device_ptr(&self) -> Option<u64> {
        self.dev
    }
}

/// How a kernel is launched besides its grid and block: programmatic dependent launch, a
/// thread-block cluster along y, a cooperative grid (all blocks co-resident), dynamic shared memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct LaunchHow {
    pub pdl: bool,
    pub cluster_y: u32,
    pub cooperative: bool,
    pub smem: u32,
}

/// A driver error as a `BackendError::Device` saying what was being done.
pub fn dev_err(
    what: impl std::fmt::Display,
) -> impl FnOnce(cudarc::driver::DriverError) -> BackendError {
    let what = what.to_string();
    move |e| BackendError::Device(format!("{what}: {e}"))
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

/// One CUDA device: its context, the stream everything runs on, and what it is.
pub struct Device {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub sm_count: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// Kernels launched on the stream so far (captured ones included): a graph's node count is
    /// the difference over its capture.
    pub launches: std::cell::Cell<u64>,
}

impl Device {
    /// Open device `ordinal` (no module is loaded).
    pub fn open(ordinal: usize) -> Result<Device, BackendError> {
        if device_count() == 0 {
            return Err(BackendError::Device(
                "no CUDA device found (driver library not loadable or no GPU)".into(),
            ));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(dev_err(format!("open CUDA device {ordinal}")))?;
        // One stream and program order: no per-buffer events (they would also break graph capture).
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx
            .compute_capability()
            .map_err(dev_err("compute capability"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err("SM count"))? as usize;
        let stream = ctx.new_stream().map_err(dev_err("create stream"))?;
        Ok(Device {
            ordinal,
            ctx,
            stream,
            sm_count,
            name,
            cc,
            launches: std::cell::Cell::new(0),
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
                device: self.name.clone(),
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
        let b = self.alloc(std::mem::size_of_val(data))?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// Copy `data` to `buf` at byte offset `off` (waits for the copy).
    pub fn write<T: Copy>(&self, buf: &DevBuf, off: usize, data: &[T]) -> Result<(), BackendError> {
        self.write_async(buf, off, data)?;
        if std::mem::size_of_val(data) == 0 {
            return Ok(()); // nothing was enqueued
        }
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

    /// Wait for everything enqueued on the stream.
    pub fn sync(&self) -> Result<(), BackendError> {
        self.stream
            .synchronize()
            .map_err(dev_err("stream synchronize (a kernel failed)"))
    }

    /// A page-locked host area of `words` u32 words for [`Device::read_staged`] (copies into pageable
    /// memory would make the host wait for the stream).
    pub fn host_stage(&self, words: usize) -> Result<HostStage, BackendError> {
        // flags 0: cached host memory (write-combined memory is slow for the host to read)
        let buf = unsafe { self.ctx.alloc_pinned_with_flags::<u32>(words.max(1), 0) }
            .map_err(dev_err("allocate page-locked host memory"))?;
        let ev = self.ctx.new_event(None).map_err(dev_err("create event"))?;
        Ok(HostStage { buf, ev })
    }

    /// A page-locked host area of `words` u32 words for [`Device::write_staged`] (write-combined:
    /// the host only writes it), or `mapped` into the device's address space for kernels to read
    /// over the bus (cached, so the device's reads see the host's last writes).
    pub fn host_write(&self, words: usize, mapped: bool) -> Result<HostWrite, BackendError> {
        let flags = if mapped {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            sys::CU_MEMHOSTALLOC_WRITECOMBINED
        };
        let mut buf = unsafe { self.ctx.alloc_pinned_with_flags::<u32>(words.max(1), flags) }
            .map_err(dev_err("allocate page-locked host memory"))?;
        let dev = if mapped {
            let host = buf
                .as_mut_ptr()
                .map_err(dev_err("page-locked host memory"))?;
            let mut d: sys::CUdeviceptr = 0;
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host as *mut c_void, 0) }
                .result()
                .map_err(dev_err("map page-locked host memory for the device"))?;
            Some(d)
        } else {
            None
        };
        Ok(HostWrite { buf, dev })
    }

    /// Enqueue a copy of the first `words` words of `src` to the start of `dst`, without waiting.
    pub fn write_staged(
        &self,
        dst: &DevBuf,
        src: &HostWrite,
        words: usize,
    ) -> Result<(), BackendError> {
        let host = src
            .buf
            .as_slice()
            .map_err(dev_err("page-locked host memory"))?;
        if words > host.len() || words * 4 > dst.bytes {
            return Err(BackendError::Device(format!(
                "staged write of {words} words: stage {} words, buffer {} bytes",
                host.len(),
                dst.bytes
            )));
        }
        unsafe { dres::memcpy_htod_async(dst.ptr, &host[..words], self.stream.cu_stream()) }
            .map_err(dev_err("copy to device"))
    }

    /// Enqueue a copy of `stage`'s words from the start of `src` into `stage` and mark its end,
    /// without waiting: later launches may follow at once, and [`HostStage::wait`] returns the words
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

    /// Copy all of `src` into `dst` (at least as large) in stream order, on the device.
    pub fn copy_async(&self, dst: &DevBuf, src: &DevBuf) -> Result<(), BackendError> {
        if dst.bytes < src.bytes {
            return Err(BackendError::Device(format!(
                "copy of {} bytes into a buffer of {}",
                src.bytes, dst.bytes
            )));
        }
        unsafe { dres::memcpy_dtod_async(dst.ptr, src.ptr, src.bytes, self.stream.cu_stream()) }
            .map_err(dev_err("device-to-device copy"))
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
    pub fn end_capture(&self) -> Result<CudaGraph, BackendError> {
        self.stream
            .end_capture(sys::CUgraphInstantiate_flags_enum(0))
            .map_err(dev_err("end graph capture"))?
            .ok_or_else(|| BackendError::Device("graph capture produced no graph".into()))
    }

    /// Replay a captured graph on the stream.
    pub fn replay(&self, g: &CudaGraph) -> Result<(), BackendError> {
        g.launch()
            .map_err(|e| BackendError::Device(format!("graph launch: {e}")))
    }

    /// The one call of `cuLaunchKernelEx`: `f` on the stream with `grid`, `block` threads and the
    /// attributes `how` asks for.
    ///
    /// # Safety
    /// `args` must hold one pointer per kernel parameter, in order, each to a live value of the
    /// parameter's type (the typed launchers pass an argument struct of `metrale_abi`, whose
    /// declaration the kernel's PTX was checked against).
    pub unsafe fn launch_raw(
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
        // SAFETY: the caller's contract (above) on `args`; `cfg` and `attrs` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(dev_err(format!("launch {what}")))?;
        self.launches.set(self.launches.get() + 1);
        Ok(())
    }

    /// The TMA tensor map of a row-major bf16 matrix `[rows][k]` at device address `ptr`, read in
    /// boxes of `box_rows` rows x 64 elements (one 128-byte row each) into shared memory in the
    /// 128-byte swizzle (`gemm_tma.cu.hbs`'s matrix descriptors name that layout); rows past
    /// `rows` read as zeros. A pure encoding: it touches no memory.
    pub fn tma_map_bf16(
        &self,
        ptr: u64,
        rows: usize,
        k: usize,
        box_rows: u32,
    ) -> Result<metrale_abi::TmaMap, BackendError> {
        if !ptr.is_multiple_of(16)
            || !(k * 2).is_multiple_of(16)
            || k < 64
            || rows == 0
            || box_rows > 256
        {
            return Err(BackendError::Invalid(format!(
                "TMA map of [{rows}][{k}] bf16 at {ptr:#x}: needs a 16-byte aligned start, rows of a multiple of 16 bytes and at least 64 elements, and boxes of at most 256 rows (asked {box_rows})"
            )));
        }
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        let dims = [k as u64, rows as u64];
        let strides = [(k * 2) as u64];
        let boxes = [64u32, box_rows];
        let elem = [1u32, 1];
        // SAFETY: every pointer names a live local array of the rank (2) the call reads; the
        // driver only encodes them into `map`.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                ptr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(dev_err(format!(
            "encode the TMA map of [{rows}][{k}] bf16 (boxes of {box_rows} rows)"
        )))?;
        Ok(metrale_abi::TmaMap(map.opaque))
    }
}
