//! metrale-attestation: what makes a kernel set trustworthy, with no compiler and no GPU in sight.
//!
//! - [`closure`]: the closure manifest of one kernel (template, rendered source, every header with its
//!   digest, the parameters, the compiler identity, the exact flags and archs) and its blake3 hash, the
//!   key of the content-addressed cache and the identity a binary is audited against.
//! - [`statement`]: in-toto Statement v1 with a SLSA provenance v1 predicate (a few serde structs: the
//!   `in-toto` crate only does v0.1), the TARGET_CLOSURES map and the KERNEL_SET_HASH.
//! - [`pack`]: the byte format of a kernel pack, the one blob `build-target` writes and the server
//!   binary embeds (section `.metrale`): written by xtask, read by the runtime and by `cargo xtask audit`.
//! - [`canonical`]: canonical JSON (sorted keys, no whitespace): every hash over structured data goes
//!   through it, so hashes never depend on map order or serde_json features.
//!
//! Invariants: no absolute path, timestamp or host name enters a hash or the embedded statement; all
//! parsing of untrusted bytes (a pack read from a file) is bounds-checked and never panics.

pub mod canonical;
pub mod closure;
pub mod pack;
pub mod statement;

use sha2::Digest;

/// Lower-case hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Lower-case hex blake3 of `bytes`.
pub fn blake3_hex(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// Error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum AttestError {
    #[error("kernel pack: {what} at byte {offset}: {detail}")]
    Pack {
        what: &'static str,
        offset: usize,
        detail: String,
    },
    #[error("attestation JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("attestation: {field}: expected {expected}, got {got}")]
    Invalid {
        field: String,
        expected: String,
        got: String,
    },
}
