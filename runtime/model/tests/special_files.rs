//! Model paths that are not regular files: a named pipe (FIFO), a socket, a character device, or a
//! directory where a file is required, as the model path or as any file of an HF checkpoint directory.
//! Each must be refused within a second with an error naming the path and what it is. The loads run
//! in a thread with a timeout, so a regression (open() blocking on a FIFO with no writer) fails the
//! test instead of hanging it; on a timeout the test opens the FIFO's write end to free the thread.
#![cfg(unix)]

mod common;
use metrale_model::{Model, ModelError};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a file.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
}

/// Load `path` in a thread; the result if it comes within a second, a test failure otherwise.
fn load_within_a_second(path: &Path, fifo: Option<&Path>) -> Result<Model, ModelError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(Model::load(&p));
    });
    match rx.recv_timeout(Duration::from_secs(1)) {
        Ok(r) => r,
        Err(_) => {
            if let Some(f) = fifo {
                // free the blocked reader: opening the write end completes its open()
                use std::os::unix::fs::OpenOptionsExt;
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(f);
            }
            panic!("loading {} blocked for more than a second", path.display());
        }
    }
}

fn refused(path: &Path, fifo: Option<&Path>, named: &Path, kind: &str) {
    let e = load_within_a_second(path, fifo)
        .expect_err("a non-regular file must be refused")
        .to_string();
    assert!(
        e.contains(&named.display().to_string()) && e.contains(kind),
        "expected {} and {kind:?} in: {e}",
        named.display()
    );
}

fn hf_fixture_copy(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    let dst = dir.join("hf");
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

#[test]
fn fifo_as_the_model_path_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.gguf");
    mkfifo(&p);
    refused(
        &p,
        Some(&p),
        &p,
        "is a named pipe (FIFO), not a regular file",
    );
}

#[test]
fn fifo_inside_an_hf_directory_is_refused_at_once() {
    // required files, optional files (read only when present) and the weights
    for name in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors",
        "chat_template.jinja",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let hf = hf_fixture_copy(dir.path());
        let f = hf.join(name);
        let _ = std::fs::remove_file(&f);
        mkfifo(&f);
        refused(&hf, Some(&f), &f, "is a named pipe (FIFO)");
    }
}

#[test]
fn socket_and_device_model_paths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&p).unwrap();
    refused(&p, None, &p, "is a socket, not a regular file");
    let null = Path::new("/dev/null");
    if null.exists() {
        refused(
            null,
            None,
            null,
            "is a character device, not a regular file",
        );
    }
}

#[test]
fn directory_where_a_file_is_required_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_fixture_copy(dir.path());
    let f = hf.join("tokenizer.json");
    std::fs::remove_file(&f).unwrap();
    std::fs::create_dir(&f).unwrap();
    refused(&hf, None, &f, "is a directory, not a regular file");
    let d = dir.path().join("weights.gguf");
    std::fs::create_dir(&d).unwrap();
    let e = metrale_model::gguf::GgufFile::open(&d)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("weights.gguf") && e.contains("is a directory"),
        "{e}"
    );
}

#[test]
fn symlinks_to_regular_files_still_load() {
    // HF caches hand out symlinks to blobs: a link is judged by what it points to
    let dir = tempfile::tempdir().unwrap();
    let real = common::tiny_llama().write(dir.path(), "real.gguf");
    let link = dir.path().join("link.gguf");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    load_within_a_second(&link, None).unwrap();
    let hf = hf_fixture_copy(dir.path());
    let cfg = hf.join("config.json");
    let blob = dir.path().join("config-blob.json");
    std::fs::rename(&cfg, &blob).unwrap();
    std::os::unix::fs::symlink(&blob, &cfg).unwrap();
    load_within_a_second(&hf, None).unwrap();
}
