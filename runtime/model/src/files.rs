//! Opening a model's files: only regular files are opened or read.
//!
//! Owns: the check every file read of this crate goes through (the GGUF file, an HF directory's JSON,
//! tokenizer, template and safetensors files). A path that is a named pipe, a socket, a character or
//! block device, or a directory where a file is required is refused with an error naming the path and
//! what it is ([`ModelError::NotRegular`]), decided by `std::fs::metadata` (a stat, which follows
//! symlinks and never blocks) before anything is opened: `open()` on a FIFO with no writer blocks
//! forever, and reading a device may never end. On Unix the open itself is non-blocking and the opened
//! file is checked again, so a path swapped for a FIFO between the two steps is refused too instead of
//! hanging.

use crate::error::{ModelError, Result};
use std::fs::{File, FileType, Metadata};
use std::path::Path;

/// What a file type is, for errors ("a named pipe (FIFO)", "a directory", ...).
pub fn describe(ft: &FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a named pipe (FIFO)";
        }
        if ft.is_socket() {
            return "a socket";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else if ft.is_file() {
        "a regular file"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn io(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn not_regular(path: &Path, ft: &FileType, expected: &'static str) -> ModelError {
    ModelError::NotRegular {
        path: path.to_path_buf(),
        kind: describe(ft),
        expected,
    }
}

/// The metadata of `path` if it is a regular file (after following symlinks); an error naming what it
/// is otherwise. Does not open the file.
pub fn regular(path: &Path) -> Result<Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
    if meta.is_file() {
        Ok(meta)
    } else {
        Err(not_regular(path, &meta.file_type(), "a regular file"))
    }
}

/// Like [`regular`], but a path that does not exist is `Ok(None)` (for optional files).
pub fn regular_if_exists(path: &Path) -> Result<Option<Metadata>> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path, e)),
        Ok(meta) if meta.is_file() => Ok(Some(meta)),
        Ok(meta) => Err(not_regular(path, &meta.file_type(), "a regular file")),
    }
}

/// The kind of a model path: `Ok(true)` for a directory (an HF checkpoint), `Ok(false)` for a regular
/// file (a GGUF), an error naming what it is for anything else.
pub fn model_path_is_dir(path: &Path) -> Result<bool> {
    let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
    if meta.is_dir() {
        Ok(true)
    } else if meta.is_file() {
        Ok(false)
    } else {
        Err(not_regular(
            path,
            &meta.file_type(),
            "a regular file (a model is a .gguf file or an HF checkpoint directory)",
        ))
    }
}

/// Open a regular file for reading; anything else is refused without blocking (see the module doc).
pub fn open(path: &Path) -> Result<File> {
    regular(path)?;
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        // O_NONBLOCK: if the path became a FIFO since the stat, open returns at once instead of
        // waiting for a writer. It changes nothing for a regular file's reads or maps.
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| io(path, e))?;
    let meta = file.metadata().map_err(|e| io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(path, &meta.file_type(), "a regular file"));
    }
    Ok(file)
}

/// Read a whole regular file.
pub fn read(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut f = open(path)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out).map_err(|e| io(path, e))?;
    Ok(out)
}

/// Read a whole regular file, or `Ok(None)` if the path does not exist.
pub fn read_if_exists(path: &Path) -> Result<Option<Vec<u8>>> {
    match regular_if_exists(path)? {
        None => Ok(None),
        Some(_) => read(path).map(Some),
    }
}

/// Read a whole regular file as UTF-8 text.
pub fn read_to_string(path: &Path) -> Result<String> {
    String::from_utf8(read(path)?).map_err(|e| ModelError::Malformed {
        path: path.to_path_buf(),
        field: "text".into(),
        msg: format!("not valid UTF-8: {}", e.utf8_error()),
    })
}
