//! The one error type of metrale-model. Every variant names the file (or says there is none) and the
//! field that was wrong, and the message says what was expected, so a user can act on it.

use std::path::PathBuf;

/// Error while reading, validating or using a model's files.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file or directory could not be opened or read.
    #[error("{}: cannot read: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The path is not a regular file where one is required: a named pipe, a socket, a device, or a
    /// directory (`kind` says which), refused before it is opened (see [`crate::files`]).
    #[error("{}: is {kind}, not {expected}", .path.display())]
    NotRegular {
        path: PathBuf,
        kind: &'static str,
        expected: &'static str,
    },
    /// The file is malformed at `field`: truncated, an absurd count or length, an offset past the end...
    #[error("{}: {field}: {msg}", .path.display())]
    Malformed {
        path: PathBuf,
        field: String,
        msg: String,
    },
    /// A value has the wrong type, shape or value.
    #[error("{}: {field}: expected {expected}, got {got}", .path.display())]
    Mismatch {
        path: PathBuf,
        field: String,
        expected: String,
        got: String,
    },
    /// A required metadata key or config field is missing.
    #[error("{}: missing {field}{}", .path.display(), hint_suffix(.hint))]
    Missing {
        path: PathBuf,
        field: String,
        hint: String,
    },
    /// A tensor is not in the model.
    #[error("{}: tensor '{name}' not found ({available} tensors present){}", .path.display(), hint_suffix(.hint))]
    MissingTensor {
        path: PathBuf,
        name: String,
        available: usize,
        hint: String,
    },
    /// The model is of an architecture this runtime does not run.
    #[error("{}: architecture '{arch}' is not supported (supported: {supported})", .path.display())]
    UnsupportedArch {
        path: PathBuf,
        arch: String,
        supported: String,
    },
    /// A feature of the file that is valid but not supported here (a tensor type, a pre-tokenizer...).
    #[error("{}: {field}: '{value}' is not supported (supported: {supported})", .path.display())]
    Unsupported {
        path: PathBuf,
        field: String,
        value: String,
        supported: String,
    },
    /// A tensor's bytes do not fit the dtype numerics (should not happen for a loaded model).
    #[error("tensor '{tensor}': {source}")]
    Numerics {
        tensor: String,
        #[source]
        source: metrale_core::dtype::DTypeError,
    },
    /// The tokenizer could not be built or failed on an input.
    #[error("tokenizer: {msg}")]
    Tokenizer { msg: String },
    /// The chat template could not be compiled or rendered.
    #[error("chat template: {msg}")]
    Template { msg: String },
}

fn hint_suffix(hint: &str) -> String {
    if hint.is_empty() {
        String::new()
    } else {
        format!("; {hint}")
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
