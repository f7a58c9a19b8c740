//! metrale-server: the HTTP face of metrale and its binary. Owns the CLI, the OpenAI-compatible API
//! (request validation, the response and SSE shapes, the error envelope), text-level concerns the
//! engine deliberately does not know (chat templates applied to messages, detokenization with UTF-8
//! and stop-string holdback) and start-up (load the model, check that this binary's target serves it,
//! size the KV cache, report capacity). Only this crate knows HTTP and JSON.
//!
//! Request flow: [`routes`] reads the body ([`api::parse_request`]: wrong types are 400s naming the
//! field), validates it into [`api::GenParams`] (unset sampling fields take the target's MODEL.toml
//! preset), renders the chat template and tokenizes, then [`generate::respond`] submits one engine
//! request per choice and turns each choice's token events into text through a
//! [`textstream::TextStreamer`], answering whole or as SSE ([`sse`]).
//!
//! Modules: [`cli`] flags; [`serve`] start-up/shutdown; [`state`] what is shared once loaded;
//! [`routes`] endpoints and API-key check; [`api`] request types and validation; [`generate`] running
//! a request; [`textstream`] stop strings + UTF-8 holdback; [`sse`] chunk shapes and framing;
//! [`error`] the envelope.
//!
//! Invariants: a client's mistake is always a 4xx in the OpenAI envelope, never a 5xx; a stop string
//! never reaches the client; streamed text is valid UTF-8 made of whole characters; dropping a
//! response (client gone, stream or not) drops the engine receivers, which cancels the generation;
//! `/health` is 503 `{"status":"loading"}` until the engine is ready.

pub mod api;
pub mod budget;
pub mod cli;
#[cfg(feature = "cuda")]
mod cuda;
pub mod error;
pub mod generate;
pub mod listen;
pub mod pool;
pub mod prepare;
pub mod routes;
pub mod serve;
pub mod sse;
pub mod state;
pub mod textstream;
