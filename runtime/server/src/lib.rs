//! metrale-server: the HTTP face of metrale and its binary. Owns the CLI, the OpenAI-compatible API
//! (request validation, the response and SSE shapes, the error envelope), text-level concerns the
//! engine deliberately does not know (chat templates applied to messages, detokenization with UTF-8
//! and stop-string holdback) and start-up (load the model, pick the backend, size the KV cache,
//! report capacity). Only this crate knows HTTP and JSON.
//!
//! Invariants: a client's mistake is always a 4xx in the OpenAI envelope, never a 5xx; a stop string
//! never reaches the client; streamed text is valid UTF-8; dropping a response (client gone) drops
//! the engine receiver, which cancels the generation.

pub mod api;
pub mod cli;
#[cfg(feature = "cuda")]
mod cuda;
pub mod error;
pub mod generate;
pub mod routes;
pub mod serve;
pub mod sse;
pub mod state;
pub mod textstream;
