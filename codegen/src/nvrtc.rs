//! NVRTC, bound by hand from the pinned toolchain's libraries (see [`crate::toolchain`] for why not
//! through a library search). One [`Nvrtc`] per process; it is Send + Sync (NVRTC programs are
//! independent, so kernels compile on several threads at once).
//!
//! A compile hands NVRTC the rendered source and every header of the kernel's closure in memory
//! (`nvrtcCreateProgram` with `headers`/`includeNames`), so the compiler sees exactly the closure, and
//! returns the cubin (`nvrtcGetCUBIN`, real arch) or the PTX (`nvrtcGetPTX`, virtual arch).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::CodegenError;

type Prog = *mut c_void;
type Res = c_int;

struct Fns {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Res,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Res,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Res,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> Res,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> Res,
    destroy: unsafe extern "C" fn(*mut Prog) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
}

/// The loaded NVRTC of the pinned toolchain.
pub struct Nvrtc {
    fns: Fns,
    lib_dir: PathBuf,
    _libs: Vec<libloading::Library>,
}

// SAFETY: the function pointers are plain C entry points of a library kept loaded for the process
// lifetime; NVRTC documents its API as thread-safe for distinct programs.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

static LOADED: OnceLock<Result<Nvrtc, String>> = OnceLock::new();

/// One compile: the program, its headers, the options, what to make of it, and for the error
/// messages the kernel, target and arch it is for.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    pub program: &'a str,
    pub source: &'a str,
    /// (include name as written, contents)
    pub headers: &'a [(String, Vec<u8>)],
    pub options: &'a [String],
    pub output: Output,
    pub kernel: &'a str,
    pub target: &'a str,
    pub arch: &'a str,
}

/// What to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Cubin,
    Ptx,
}

impl Nvrtc {
    /// Loads NVRTC from `lib_dir` (once per process; a second, different folder is an error).
    pub fn load(lib_dir: &Path) -> Result<&'static Nvrtc, CodegenError> {
        let r = LOADED.get_or_init(|| unsafe { Self::open(lib_dir) }.map_err(|e| e.to_string()));
        match r {
            Ok(n) if n.lib_dir == lib_dir => Ok(n),
            Ok(n) => Err(CodegenError::Toolchain {
                dir: lib_dir.to_path_buf(),
                detail: format!(
                    "this process already loaded NVRTC from {}",
                    n.lib_dir.display()
                ),
            }),
            Err(e) => Err(CodegenError::Toolchain {
                dir: lib_dir.to_path_buf(),
                detail: e.clone(),
            }),
        }
    }

    unsafe fn open(lib_dir: &Path) -> Result<Nvrtc, CodegenError> {
        let open = |name: &str| -> Result<libloading::Library, CodegenError> {
            let p = lib_dir.join(name);
            libloading::Library::new(&p).map_err(|e| CodegenError::Toolchain {
                dir: lib_dir.to_path_buf(),
                detail: format!("cannot load {}: {e}", p.display()),
            })
        };
        // builtins first: libnvrtc dlopens it by soname, which then resolves to this loaded copy.
        let builtins = open("libnvrtc-builtins.so.13.0")?;
        let lib = open("libnvrtc.so.13")?;
        macro_rules! sym {
            ($name:literal) => {
                *lib.get($name).map_err(|e| CodegenError::Toolchain {
                    dir: lib_dir.to_path_buf(),
                    detail: format!(
                        "symbol {} missing: {e}",
                        String::from_utf8_lossy(&$name[..$name.len() - 1])
                    ),
                })?
            };
        }
        let fns = Fns {
            version: sym!(b"nvrtcVersion\0"),
            create: sym!(b"nvrtcCreateProgram\0"),
            compile: sym!(b"nvrtcCompileProgram\0"),
            log_size: sym!(b"nvrtcGetProgramLogSize\0"),
            log: sym!(b"nvrtcGetProgramLog\0"),
            ptx_size: sym!(b"nvrtcGetPTXSize\0"),
            ptx: sym!(b"nvrtcGetPTX\0"),
            cubin_size: sym!(b"nvrtcGetCUBINSize\0"),
            cubin: sym!(b"nvrtcGetCUBIN\0"),
            destroy: sym!(b"nvrtcDestroyProgram\0"),
            error_string: sym!(b"nvrtcGetErrorString\0"),
        };
        Ok(Nvrtc {
            fns,
            lib_dir: lib_dir.to_path_buf(),
            _libs: vec![builtins, lib],
        })
    }

    /// (major, minor) as NVRTC reports it.
    pub fn version(&self) -> Result<(i32, i32), CodegenError> {
        let (mut a, mut b) = (0, 0);
        self.check("nvrtcVersion", unsafe {
            (self.fns.version)(&mut a, &mut b)
        })?;
        Ok((a, b))
    }

    fn check(&self, call: &'static str, r: Res) -> Result<(), CodegenError> {
        if r == 0 {
            return Ok(());
        }
        let msg = unsafe {
            let p = (self.fns.error_string)(r);
            if p.is_null() {
                format!("error {r}")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(CodegenError::Nvrtc {
            call,
            code: r,
            message: msg,
        })
    }

    /// Compiles `job.source` (named `job.program`) with its headers in memory. On a compile error,
    /// returns `CodegenError::Compile` with NVRTC's log.
    pub fn compile(&self, job: &Job<'_>) -> Result<(Vec<u8>, String), CodegenError> {
        let Job {
            program,
            source,
            headers,
            options,
            output,
            kernel,
            target,
            arch,
        } = *job;
        let cstr = |s: &[u8], what: &str| {
            CString::new(s).map_err(|_| CodegenError::Compile {
                target: target.into(),
                kernel: kernel.into(),
                arch: arch.into(),
                log: format!("{what} contains a NUL byte"),
            })
        };
        let src = cstr(source.as_bytes(), "the rendered source")?;
        let name = cstr(program.as_bytes(), "the program name")?;
        let mut hdr_src = Vec::new();
        let mut hdr_names = Vec::new();
        for (n, b) in headers {
            hdr_names.push(cstr(n.as_bytes(), n)?);
            hdr_src.push(cstr(b, n)?);
        }
        let hs: Vec<*const c_char> = hdr_src.iter().map(|c| c.as_ptr()).collect();
        let hn: Vec<*const c_char> = hdr_names.iter().map(|c| c.as_ptr()).collect();
        let opts: Vec<CString> = options
            .iter()
            .map(|o| cstr(o.as_bytes(), "an option"))
            .collect::<Result<_, _>>()?;
        let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        unsafe {
            self.check(
                "nvrtcCreateProgram",
                (self.fns.create)(
                    &mut prog,
                    src.as_ptr(),
                    name.as_ptr(),
                    hs.len() as c_int,
                    if hs.is_empty() {
                        std::ptr::null()
                    } else {
                        hs.as_ptr()
                    },
                    if hn.is_empty() {
                        std::ptr::null()
                    } else {
                        hn.as_ptr()
                    },
                ),
            )?;
            let result = (|| {
                let r = (self.fns.compile)(prog, op.len() as c_int, op.as_ptr());
                let mut n = 0usize;
                self.check("nvrtcGetProgramLogSize", (self.fns.log_size)(prog, &mut n))?;
                let mut log = vec![0u8; n.max(1)];
                self.check(
                    "nvrtcGetProgramLog",
                    (self.fns.log)(prog, log.as_mut_ptr() as *mut c_char),
                )?;
                let log = String::from_utf8_lossy(
                    &log[..log.iter().position(|&c| c == 0).unwrap_or(log.len())],
                )
                .into_owned();
                if r != 0 {
                    return Err(CodegenError::Compile {
                        target: target.into(),
                        kernel: kernel.into(),
                        arch: arch.into(),
                        log,
                    });
                }
                let bytes = match output {
                    Output::Cubin => {
                        self.check("nvrtcGetCUBINSize", (self.fns.cubin_size)(prog, &mut n))?;
                        let mut v = vec![0u8; n];
                        self.check(
                            "nvrtcGetCUBIN",
                            (self.fns.cubin)(prog, v.as_mut_ptr() as *mut c_char),
                        )?;
                        v
                    }
                    Output::Ptx => {
                        self.check("nvrtcGetPTXSize", (self.fns.ptx_size)(prog, &mut n))?;
                        let mut v = vec![0u8; n];
                        self.check(
                            "nvrtcGetPTX",
                            (self.fns.ptx)(prog, v.as_mut_ptr() as *mut c_char),
                        )?;
                        // the PTX size counts its NUL terminator; blobs hold the text only
                        while v.last() == Some(&0) {
                            v.pop();
                        }
                        v
                    }
                };
                Ok((bytes, log))
            })();
            let _ = (self.fns.destroy)(&mut prog);
            result
        }
    }
}
