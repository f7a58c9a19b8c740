//! metrale-server: the HTTP face of metrale and its binary. Owns the CLI, the OpenAI-compatible API
//! (request validation, the response and SSE shapes, the error envelope), text-level concerns the
//! engine deliberately does not know (chat templates applied to messages, detokenization with UTF-8
//! and stop-string holdback), what a client may make the server pay (connections, timeouts, the
//! waiting queue, the memory budget) and start-up/shutdown (load the model, check that this
//! binary's target serves it, size the KV cache, report capacity; drain). Only this crate knows HTTP
//! and JSON.
//!
//! Request flow: [`listen`] accepts the connection (cap, timeouts); [`routes`] checks the API key and
//! the queue limit, reads the body ([`routes::RequestBody`]: within the client timeout, reserved
//! against the [`budget`]), then runs [`prepare`] on the [`pool`] (parse; validate into
//! [`api::GenParams`], unset sampling fields taking the target's MODEL.toml preset; render the chat
//! template; tokenize, each step bounded before it is paid for); [`generate::respond`] submits one
//! engine request per choice and turns each choice's token events into text through a
//! [`textstream::TextStreamer`], answering whole or as SSE ([`sse`]).
//!
//! Modules: [`cli`] flags; [`grammar`] structured output (llguidance); [`tools`] tool calling;
//! [`responses`] the Responses API on the chat pipeline; [`serve`] start-up/drain; [`listen`] the accept loop; [`state`] what is
//! shared; [`routes`] endpoints, API-key and admission checks; [`budget`] the memory budget;
//! [`pool`] the preprocessing threads; [`prepare`] body to job; [`api`] request types and
//! validation; [`generate`] running a request; [`textstream`] stop strings + UTF-8 holdback; [`sse`]
//! chunk shapes and framing; [`error`] the envelope; [`webui`] the chat page at `/`.
//!
//! Invariants: a client's mistake is always a 4xx in the OpenAI envelope, never a 5xx; a stop string
//! never reaches the client; streamed text is valid UTF-8 made of whole characters; dropping a
//! response (client gone, stream or not) drops the engine receivers, which cancels the generation;
//! `/health` is 503 `{"status":"loading"}` until the engine is ready and never waits on another
//! request's work; no request allocates in proportion to its input before reserving that worst
//! case; every request that was accepted gets an ending (its answer, or after the drain deadline an
//! error and `[DONE]`).

pub mod api;
pub mod budget;
pub mod cli;
#[cfg(feature = "cuda")]
mod cuda;
pub mod embeddings;
pub mod error;
pub mod generate;
pub mod grammar;
pub mod harmony;
pub mod listen;
pub mod pool;
pub mod prepare;
pub mod reasoning;
pub mod responses;
pub mod routes;
pub mod serve;
pub mod sse;
pub mod state;
pub mod textstream;
pub mod tools;
pub mod webui;
