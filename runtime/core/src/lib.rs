//! metrale-core: the vocabulary every other crate shares and nothing else: element types and their host
//! numerics (f16/bf16/quantized blocks), target specifications (`targets/` TOML parsed into typed
//! structs), the model shape (`shape::Dims`), and the error types crossing crate seams. No I/O beyond reading a target's TOML, no GPU.

pub mod dtype;
pub mod format;
pub use format::{fp8, kquant};
pub mod shape;
pub mod target;

/// Error of a backend (CPU or CUDA) while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("device: {0}")]
    Device(String),
    #[error("out of memory on {device}: needed {needed} bytes, {free} free; {hint}")]
    OutOfMemory {
        device: String,
        needed: u64,
        free: u64,
        hint: String,
    },
    #[error("model: {0}")]
    Model(String),
    #[error("invalid request: {0}")]
    Invalid(String),
}
