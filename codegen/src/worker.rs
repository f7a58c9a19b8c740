//! NVRTC in a fresh process for every compile.
//!
//! Why: NVRTC 13.0.88's output depends on heap addresses. Measured 2026-11-30 on this project's
//! kernels: identical builds gave 2-4 different `.ptx` files for some kernels (virtual-register
//! numbering and a few moves in `lm_head`, `attn_in`, `attn_out`, `ffn_in`; cubins were stable)
//! - with every compile in one process (state left by earlier compiles), and
//! - with one fresh process per compile, as long as address-space randomisation was on;
//!
//! while one fresh process per compile with randomisation off (`personality(ADDR_NO_RANDOMIZE)`)
//! gave byte-identical blobs in every run of one worker executable. Two more things moved the heap:
//! - the worker executable's size (measured 2026-12-01: 6 of 322 blobs changed after padding xtask
//!   by 3 MB): NVRTC runs in a thread of its own, whose malloc arena glibc maps at an address
//!   independent of the executable;
//! - the length of the toolchain folder's path (measured 2026-12-01: two clones whose paths differed
//!   by two characters built different `a100/smollm2-135m/q4_1` decode PTX and cubins): NVRTC
//!   calls `getcwd` and keeps the answer, and the dynamic loader keeps the library's path. So the
//!   worker starts in the toolchain folder, opens it, moves to `/` and names everything through
//!   `/proc/self/fd/<n>/`, a path of the same length wherever the clone and the toolchain live.
//!
//! A blob that depends on chance or on where the repository lives breaks the attestation's promise
//! and `audit --rebuild`, so every compile runs in such a child: a fresh process, no randomisation,
//! working directory `/`, and a request that holds no path (the include path carries
//! [`crate::TOOLCHAIN_PLACEHOLDER`], which the worker replaces).
//!
//! The child is an executable that calls [`serve_if_worker`] first thing in `main` (xtask does);
//! the parent starts it with the environment variable [`ENV`] set, writes one JSON [`Request`] to its
//! stdin and reads one JSON [`Response`] from its stdout.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::nvrtc::{Job, Nvrtc, Output};
use crate::CodegenError;

/// Set (to anything) in a worker's environment.
pub const ENV: &str = "METRALE_NVRTC_WORKER";

#[derive(Serialize, Deserialize)]
struct Request {
    program: String,
    source: String,
    /// (include name, contents as hex)
    headers: Vec<(String, String)>,
    options: Vec<String>,
    cubin: bool,
    kernel: String,
    target: String,
    arch: String,
}

#[derive(Serialize, Deserialize)]
enum Response {
    /// The blob as hex, and NVRTC's log.
    Ok { blob: String, log: String },
    /// The source did not compile: NVRTC's log.
    CompileError { log: String },
    /// Anything else (toolchain not loadable, an NVRTC call failed): the message.
    Failed { message: String },
}

/// In a worker process (env [`ENV`] set): serve one request from stdin and exit. Otherwise return
/// at once. Call it first thing in `main` of every binary passed as a worker.
pub fn serve_if_worker() {
    if std::env::var_os(ENV).is_none() {
        return;
    }
    // Reach the toolchain folder (our working directory, set by the parent) through a descriptor
    // and move to "/": see the module docs.
    let root = match std::fs::File::open(".") {
        Ok(dir) => {
            use std::os::fd::IntoRawFd;
            let fd = dir.into_raw_fd(); // open for the life of the process
            std::env::set_current_dir("/").map(|_| format!("/proc/self/fd/{fd}"))
        }
        Err(e) => Err(e),
    };
    // NVRTC runs in a thread of its own: glibc gives a new thread a new malloc arena, in memory
    // mapped where the address-space layout puts it, so every allocation NVRTC sees (its static
    // initialisers at load included) lies at addresses that do not depend on the size of this
    // executable, which the main thread's heap (right after the executable's data) does.
    let response = match root {
        Ok(root) => std::thread::spawn(move || serve(&root))
            .join()
            .unwrap_or_else(|_| Response::Failed {
                message: "the NVRTC worker thread panicked".into(),
            }),
        Err(e) => Response::Failed {
            message: format!("cannot open the toolchain folder: {e}"),
        },
    };
    let text = serde_json::to_string(&response).expect("a response always serialises");
    let mut out = std::io::stdout().lock();
    let ok = out
        .write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .is_ok();
    std::process::exit(if ok { 0 } else { 1 });
}

/// Serve one request; `root` names the toolchain folder (`/proc/self/fd/<n>`).
fn serve(root: &str) -> Response {
    let mut input = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut input) {
        return Response::Failed {
            message: format!("reading the request: {e}"),
        };
    }
    let req: Request = match serde_json::from_str(&input) {
        Ok(r) => r,
        Err(e) => {
            return Response::Failed {
                message: format!("malformed request: {e}"),
            }
        }
    };
    let mut headers = Vec::new();
    for (name, h) in req.headers {
        match hex::decode(&h) {
            Ok(b) => headers.push((name, b)),
            Err(e) => {
                return Response::Failed {
                    message: format!("header {name}: {e}"),
                }
            }
        }
    }
    let nv = match Nvrtc::load(&Path::new(root).join("lib")) {
        Ok(n) => n,
        Err(e) => {
            return Response::Failed {
                message: e.to_string(),
            }
        }
    };
    let output = if req.cubin {
        Output::Cubin
    } else {
        Output::Ptx
    };
    match nv.compile(&Job {
        program: &req.program,
        source: &req.source,
        headers: &headers,
        options: &req
            .options
            .iter()
            .map(|o| o.replace(crate::TOOLCHAIN_PLACEHOLDER, root))
            .collect::<Vec<_>>(),
        output,
        kernel: &req.kernel,
        target: &req.target,
        arch: &req.arch,
    }) {
        Ok((blob, log)) => Response::Ok {
            blob: hex::encode(blob),
            log,
        },
        Err(CodegenError::Compile { log, .. }) => Response::CompileError { log },
        Err(e) => Response::Failed {
            message: e.to_string(),
        },
    }
}

/// Compile in a fresh worker process (`worker` started with [`ENV`] set, in `toolchain_dir`, without
/// address randomisation); same contract as [`Nvrtc::compile`]. `options` name the toolchain folder
/// by [`crate::TOOLCHAIN_PLACEHOLDER`].
#[allow(clippy::too_many_arguments)]
pub fn compile(
    worker: &Path,
    toolchain_dir: &Path,
    job: &Job<'_>,
) -> Result<(Vec<u8>, String), CodegenError> {
    let kernel = job.kernel;
    let failed = |message: String| CodegenError::Worker {
        kernel: kernel.into(),
        worker: worker.to_path_buf(),
        message,
    };
    let req = Request {
        program: job.program.into(),
        source: job.source.into(),
        headers: job
            .headers
            .iter()
            .map(|(n, b)| (n.clone(), hex::encode(b)))
            .collect(),
        options: job.options.to_vec(),
        cubin: job.output == Output::Cubin,
        kernel: job.kernel.into(),
        target: job.target.into(),
        arch: job.arch.into(),
    };
    let body = serde_json::to_vec(&req).map_err(|e| failed(e.to_string()))?;
    let mut cmd = Command::new(worker);
    no_address_randomisation(&mut cmd);
    let mut child = cmd
        .current_dir(toolchain_dir)
        .env(ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| failed(format!("cannot start: {e}")))?;
    // The request is small next to a pipe's buffer only for tiny kernels: write from a thread so a
    // child that answers early cannot deadlock against us.
    let mut stdin = child.stdin.take().expect("piped");
    let writer = std::thread::spawn(move || stdin.write_all(&body));
    let out = child
        .wait_with_output()
        .map_err(|e| failed(e.to_string()))?;
    writer
        .join()
        .expect("writer thread")
        .map_err(|e| failed(format!("writing the request: {e}")))?;
    if !out.status.success() {
        return Err(failed(format!(
            "exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    match serde_json::from_slice::<Response>(&out.stdout) {
        Ok(Response::Ok { blob, log }) => Ok((hex::decode(blob).map_err(|e| failed(e.to_string()))?, log)),
        Ok(Response::CompileError { log }) => Err(CodegenError::Compile { target: job.target.into(), kernel: kernel.into(), arch: job.arch.into(), log }),
        Ok(Response::Failed { message }) => Err(failed(message)),
        Err(e) => Err(failed(format!("unreadable answer ({e}); is it a binary that calls metrale_codegen::worker::serve_if_worker()?"))),
    }
}

/// The child starts with address-space randomisation off (Linux `personality`), which NVRTC needs
/// for reproducible PTX (see the module docs).
#[cfg(target_os = "linux")]
fn no_address_randomisation(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: personality(2) is a plain system call, safe between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let current = libc::personality(0xffff_ffff);
            if current == -1
                || libc::personality(
                    (current as libc::c_ulong) | libc::ADDR_NO_RANDOMIZE as libc::c_ulong,
                ) == -1
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn no_address_randomisation(_cmd: &mut Command) {}
