//! One request's generation, from validated parameters to response bytes: submits one engine
//! request per choice, turns each choice's token events into text deltas (through a
//! [`TextStreamer`]) and logprob entries, and assembles either a whole response or an SSE stream.
//!
//! Invariants: every choice's receiver lives inside the returned future/stream, so a client that
//! goes away drops it and the engine cancels that sequence; a choice that hits a stop string drops
//! its receiver at once (the engine stops generating it); usage counts every generated token the
//! engine produced for the response, including the token that completed a stop string or EOS; when
//! the shutdown deadline passes (`abort`), a stream ends with an error event and `[DONE]` and a whole
//! response is a 503, so no client is left without an ending.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, SelectAll, StreamExt};
use metrale_engine::{Event, FinishReason, GenerateRequest, SubmitError};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;

use crate::error::ApiError;
use crate::prepare::Job;
use crate::sse::{self, Header, Kind, TokenLogprob, Usage};
use crate::state::{Served, Ticket};
use crate::textstream::TextStreamer;

/// The one line a request leaves on stderr when it ends (`--log-format text|json`): its id, the
/// tokens in (and from the prefix cache) and out, time to the first token and in all (from the
/// start of generation), each choice's finish reason, and how it ended: `ok`, `error`, or
/// `cancelled` (the client went away: written when the response is dropped).
struct RequestLog {
    id: String,
    kind: Kind,
    json: bool,
    started: std::time::Instant,
    first_token: Option<std::time::Duration>,
    usage: Usage,
    finish: Vec<&'static str>,
    written: bool,
}

impl RequestLog {
    fn new(header: &Header, json: bool, n: usize) -> RequestLog {
        RequestLog {
            id: header.id.clone(),
            kind: header.kind,
            json,
            started: std::time::Instant::now(),
            first_token: None,
            usage: Usage::default(),
            finish: vec![""; n],
            written: false,
        }
    }

    fn token(&mut self) {
        self.first_token
            .get_or_insert_with(|| self.started.elapsed());
    }

    fn end(&mut self, outcome: &str) {
        if std::mem::replace(&mut self.written, true) {
            return;
        }
        let total = self.started.elapsed().as_secs_f64();
        let ttft = self.first_token.map(|d| d.as_secs_f64());
        let u = self.usage;
        let kind = match self.kind {
            Kind::Chat => "chat",
            Kind::Completion => "completion",
            Kind::Responses => "responses",
        };
        if self.json {
            let line = serde_json::json!({
                "event": "request", "id": self.id, "kind": kind, "outcome": outcome,
                "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                "completion_tokens": u.completion_tokens, "ttft_s": ttft, "duration_s": total,
                "finish_reasons": self.finish,
            });
            eprintln!("{line}");
        } else {
            eprintln!(
                "request {} {kind} {outcome}: prompt {} (cached {}), completion {}, ttft {}, total {total:.3} s, finish {}",
                self.id,
                u.prompt_tokens,
                u.cached_tokens,
                u.completion_tokens,
                ttft.map_or("-".into(), |t| format!("{t:.3} s")),
                self.finish.join(",")
            );
        }
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        self.end("cancelled");
    }
}

/// Map an engine refusal to the client-facing error.
pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::PromptTooLong { prompt, capacity } => too_long(prompt, capacity),
        SubmitError::EmptyPrompt => {
            ApiError::invalid("the prompt is empty (0 tokens)", Some("prompt"))
        }
        SubmitError::Stopped(m) => ApiError::unavailable(format!("the engine has stopped: {m}")),
    }
}

/// The 400 for a prompt that does not fit the context, with both counts.
pub fn too_long(prompt: usize, capacity: usize) -> ApiError {
    ApiError::invalid_code(
        format!(
            "this model's maximum context length is {capacity} tokens, but the prompt has {prompt} tokens; \
             shorten the prompt, or restart the server with a larger --ctx-size"
        ),
        Some("messages"),
        "context_length_exceeded",
    )
}

/// What one choice produced since the last poll.
enum ChoiceOut {
    Delta {
        index: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// The choice ended (its last text came as a `Delta` before this).
    Finish {
        index: usize,
        logprobs: Vec<TokenLogprob>,
        reason: &'static str,
        completion_tokens: usize,
        /// Of those, the thought's (`Usage::reasoning_tokens`).
        reasoning_tokens: usize,
        /// Prompt tokens the prefix cache served this choice.
        cached_tokens: usize,
        /// The tool calls the text made (streamed already as `ToolCall`s; `reason` "tool_calls").
        tool_calls: Option<Vec<crate::tools::Call>>,
    },
    /// A piece of the model's thought (`crate::reasoning`), before the content's deltas.
    Reasoning {
        index: usize,
        text: String,
    },
    /// A piece of a tool call (tools offered): its start or more of its arguments.
    ToolCall {
        index: usize,
        event: crate::tools::ToolEvent,
    },
    Error {
        error: ApiError,
    },
}

/// One running choice: the engine receiver and the text state.
struct Choice {
    index: usize,
    rx: Option<UnboundedReceiver<Event>>,
    streamer: TextStreamer,
    served: Arc<Served>,
    want_logprobs: bool,
    stop_tokens: Vec<u32>,
    ignore_eos: bool,
    tokens: usize,
    pending_logprobs: Vec<TokenLogprob>,
    link: Arc<metrale_engine::RequestLink>,
    /// Offered tools: the text goes through the streaming reader of calls.
    tools: Option<crate::tools::ToolStream>,
    /// The text is split into thought and content first (`--reasoning-format`).
    reasoning: Option<crate::reasoning::Splitter>,
    /// Tokens that came while a thought was open, or opened or closed it (`usage`).
    reasoning_tokens: usize,
    /// Tokens before any thought opened, held until the text says whether one did (`<think>`
    /// arrives in pieces).
    start_tokens: usize,
    /// gpt-oss's harmony messages (`crate::harmony`): thought, content and calls by channel, in
    /// place of `reasoning` and `tools`.
    harmony: Option<crate::harmony::Stream>,
    /// What the last text produced beyond the one item `next` returns.
    queued: VecDeque<ChoiceOut>,
}

impl Choice {
    /// Queue what `text` makes (tools offered: content and call pieces); `finish`: the choice's
    /// last text, then its `Finish` with `reason` (`tool_calls` when a call was made and the
    /// generation was not cut by the length limit).
    fn queue_text(&mut self, text: String, finish: Option<(&'static str, usize, usize)>) {
        let index = self.index;
        if let Some(h) = &mut self.harmony {
            let outs = h.text(&text);
            self.queue_harmony(outs);
            if let Some(end) = finish {
                let calls = self.harmony.take().and_then(crate::harmony::Stream::finish);
                self.queue_finish(end, calls);
            }
            return;
        }
        // the thought first; the content goes on to the tools' reader
        let text = match &mut self.reasoning {
            Some(sp) => {
                let (mut thought, mut content) = sp.push(&text);
                if finish.is_some() {
                    let (t, c) = self.reasoning.take().expect("checked").finish();
                    thought += &t;
                    content += &c;
                }
                if !thought.is_empty() {
                    self.queued.push_back(ChoiceOut::Reasoning {
                        index,
                        text: thought,
                    });
                }
                content
            }
            None => text,
        };
        let mut events = match &mut self.tools {
            Some(ts) => ts.push(&text),
            None if text.is_empty() => Vec::new(),
            None => vec![crate::tools::ToolEvent::Text(text)],
        };
        let mut calls = None;
        if finish.is_some() {
            if let Some(ts) = self.tools.take() {
                let (last, c) = ts.finish();
                events.extend(last);
                calls = c;
            }
        }
        for e in events {
            self.queue_event(e);
        }
        if let Some(end) = finish {
            self.queue_finish(end, calls);
        }
    }

    /// Queue a content piece or a call's piece.
    fn queue_event(&mut self, e: crate::tools::ToolEvent) {
        let index = self.index;
        self.queued.push_back(match e {
            crate::tools::ToolEvent::Text(text) => ChoiceOut::Delta {
                index,
                text,
                logprobs: std::mem::take(&mut self.pending_logprobs),
            },
            event => ChoiceOut::ToolCall { index, event },
        });
    }

    /// Queue what the harmony stream made of a token.
    fn queue_harmony(&mut self, outs: Vec<crate::harmony::Out>) {
        for o in outs {
            match o {
                crate::harmony::Out::Thought(text) => self.queued.push_back(ChoiceOut::Reasoning {
                    index: self.index,
                    text,
                }),
                crate::harmony::Out::Tool(e) => self.queue_event(e),
            }
        }
    }

    /// Queue the choice's `Finish` (`tool_calls` when a call was made and the generation was not
    /// cut by the length limit).
    fn queue_finish(
        &mut self,
        (reason, completion_tokens, cached_tokens): (&'static str, usize, usize),
        calls: Option<Vec<crate::tools::Call>>,
    ) {
        let reason = if calls.is_some() && reason != "length" {
            "tool_calls"
        } else {
            reason
        };
        self.queued.push_back(ChoiceOut::Finish {
            index: self.index,
            logprobs: std::mem::take(&mut self.pending_logprobs),
            reason,
            completion_tokens,
            reasoning_tokens: self.reasoning_tokens,
            cached_tokens,
            tool_calls: calls,
        });
    }

    /// Count the token just queued as the thought's or not, from the splitter's (at start,
    /// thinking) before it: inside the thought it is; before any, it waits in `start_tokens` until
    /// the text opens a thought (then those tokens were its opening) or rules one out.
    fn count_reasoning(&mut self, before: Option<(bool, bool)>) {
        let Some(sp) = &self.reasoning else { return };
        match before {
            Some((_, true)) => self.reasoning_tokens += 1,
            Some((true, false)) => {
                self.start_tokens += 1;
                if sp.opened() {
                    self.reasoning_tokens += std::mem::take(&mut self.start_tokens);
                } else if !sp.at_start() {
                    self.start_tokens = 0;
                }
            }
            _ => {}
        }
    }

    fn logprob_entry(&self, id: u32, logprob: f32, top: &[(u32, f32)]) -> TokenLogprob {
        let tk = &self.served.model.tokenizer;
        let piece = |id: u32| {
            let b = tk.token_bytes(id);
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        let (text, bytes) = piece(id);
        TokenLogprob {
            text,
            bytes,
            logprob,
            top: top
                .iter()
                .map(|&(t, lp)| {
                    let (s, b) = piece(t);
                    (s, b, lp)
                })
                .collect(),
        }
    }

    async fn next(&mut self) -> Option<ChoiceOut> {
        loop {
            if let Some(out) = self.queued.pop_front() {
                return Some(out);
            }
            let ev = self.rx.as_mut()?.recv().await;
            match ev {
                Some(Event::Token {
                    id,
                    logprob,
                    top_logprobs,
                }) => {
                    self.tokens += 1;
                    let is_stop_token = !self.ignore_eos && self.stop_tokens.contains(&id);
                    if is_stop_token {
                        continue; // the engine ends the sequence; EOS is never rendered
                    }
                    if self.want_logprobs {
                        let e = self.logprob_entry(id, logprob, &top_logprobs);
                        self.pending_logprobs.push(e);
                    }
                    let tk = &self.served.model.tokenizer;
                    let marker = match (&self.harmony, tk.is_special(id)) {
                        (Some(_), true) => crate::harmony::Marker::of(&String::from_utf8_lossy(
                            tk.token_bytes_ref(id),
                        )),
                        _ => None,
                    };
                    let bytes = if tk.is_special(id) {
                        Vec::new()
                    } else {
                        tk.token_bytes(id)
                    };
                    if let Some(h) = &self.harmony {
                        // a token of the thought's body (its closing `<|end|>` included)
                        self.reasoning_tokens += h.thinking() as usize;
                    }
                    let r = self.streamer.push(&bytes);
                    let before = self
                        .reasoning
                        .as_ref()
                        .map(|s| (s.at_start(), s.thinking()));
                    if r.stopped {
                        // a stop string: the engine counts it as a stop, then the dropped
                        // receiver cancels the rest of this sequence
                        self.link.end_on_stop_string();
                        self.rx = None;
                        let end = ("stop", self.tokens, self.link.cached_tokens());
                        self.reasoning_tokens += before.is_some_and(|b| b.1) as usize;
                        self.queue_text(r.text, Some(end));
                        continue;
                    }
                    self.queue_text(r.text, None);
                    self.count_reasoning(before);
                    if let (Some(m), Some(h)) = (marker, &mut self.harmony) {
                        let outs = h.marker(m);
                        self.queue_harmony(outs);
                    }
                }
                Some(Event::Done {
                    reason,
                    completion_tokens,
                    cached_tokens,
                    ..
                }) => {
                    self.rx = None;
                    let last = self.streamer.finish();
                    let reason = match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    };
                    let end = (reason, completion_tokens.max(self.tokens), cached_tokens);
                    self.queue_text(last, Some(end));
                }
                // only embedding requests (crate::embeddings) get one
                Some(Event::Embedding(_)) => {}
                Some(Event::Error(m)) => {
                    self.rx = None;
                    return Some(ChoiceOut::Error {
                        error: ApiError::internal(format!("generation failed: {m}")),
                    });
                }
                None => {
                    self.rx = None;
                    return Some(ChoiceOut::Error {
                        error: ApiError::unavailable(
                            "the engine stopped before this request finished",
                        ),
                    });
                }
            }
        }
    }

    fn into_stream(self) -> BoxStream<'static, ChoiceOut> {
        stream::unfold(self, |mut c| async move { c.next().await.map(|o| (o, c)) }).boxed()
    }
}

/// Submit every choice to the engine; errors here are answered before any byte is sent.
fn start(
    served: &Arc<Served>,
    job: &Job,
) -> Result<(SelectAll<BoxStream<'static, ChoiceOut>>, usize), ApiError> {
    let p = &job.params;
    let cap = served.ctx_size;
    let mut all = SelectAll::new();
    let mut prompt_tokens = 0;
    // Check every prompt before submitting any, so a refused request starts no work.
    for prompt in &job.prompts {
        if prompt.is_empty() {
            return Err(ApiError::invalid(
                "the prompt is empty (0 tokens)",
                Some("prompt"),
            ));
        }
        if prompt.len() > cap {
            let mut e = too_long(prompt.len(), cap);
            if job.kind == Kind::Completion {
                e.param = Some("prompt".into());
            }
            return Err(e);
        }
    }
    for (pi, prompt) in job.prompts.iter().enumerate() {
        prompt_tokens += prompt.len();
        // The first token is sampled from the prompt's last position, so a prompt of exactly `cap`
        // tokens still gets one (the engine clips the same way).
        let room = cap + 1 - prompt.len();
        let max_tokens = p
            .max_tokens
            .or(served.default_max_tokens)
            .unwrap_or(room)
            .min(room);
        for j in 0..p.n {
            let mut sampling = p.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(j as u64);
            let link = Arc::new(metrale_engine::RequestLink::default());
            let req = GenerateRequest {
                prompt: prompt.clone(),
                max_tokens,
                sampling,
                stop_tokens: served.stop_tokens.clone(),
                ignore_eos: p.ignore_eos,
                link: link.clone(),
                constraint: p.grammar.as_ref().map(|g| g.constraint_for(p.reasoning)),
                embed: None,
            };
            let rx = served.engine.submit(req).map_err(submit_error)?;
            all.push(
                Choice {
                    index: pi * p.n + j,
                    rx: Some(rx),
                    streamer: TextStreamer::new(p.stops.clone()),
                    served: served.clone(),
                    want_logprobs: p.logprobs.is_some(),
                    stop_tokens: served.stop_tokens.clone(),
                    ignore_eos: p.ignore_eos,
                    tokens: 0,
                    pending_logprobs: Vec::new(),
                    link,
                    tools: match p.harmony {
                        true => None,
                        false => p.tools.clone().map(crate::tools::ToolStream::new),
                    },
                    reasoning: p.reasoning.map(crate::reasoning::Splitter::new),
                    reasoning_tokens: 0,
                    start_tokens: 0,
                    harmony: p.harmony.then(crate::harmony::Stream::new),
                    queued: VecDeque::new(),
                }
                .into_stream(),
            );
        }
    }
    Ok((all, prompt_tokens))
}

fn new_id(kind: Kind) -> String {
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
        Kind::Responses => return crate::responses::new_id(),
    };
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The error a request gets when the shutdown deadline ends it.
fn shut_down() -> ApiError {
    ApiError::unavailable(
        "the server shut down before this request finished (its --shutdown-timeout passed); retry on \
         another replica or once it is back",
    )
}

/// Resolves once `abort` is true (never, if its sender is gone without it).
async fn aborted(abort: &mut watch::Receiver<bool>) {
    if abort.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Run a job and answer it, whole or streamed; `abort` turning true ends it early.
/// `ticket` (the request's place in the queue) is let go at the first generated token.
pub async fn respond(
    served: Arc<Served>,
    job: Job,
    ticket: Option<Ticket>,
    abort: watch::Receiver<bool>,
) -> Result<Response, ApiError> {
    let (choices, prompt_tokens) = start(&served, &job)?;
    let header = Header {
        kind: job.kind,
        id: new_id(job.kind),
        created: now(),
        model: served.name.clone(),
        include_usage: job.params.include_usage,
    };
    let n_choices = job.prompts.len() * job.params.n;
    let mut log = RequestLog::new(&header, served.log_json, n_choices);
    log.usage.prompt_tokens = prompt_tokens;
    let echo = job.responses.clone();
    if job.params.stream {
        Ok(stream_response(
            header,
            choices,
            (served.sse_keepalive, log),
            (n_choices, job.params.n),
            (job.params.logprobs.is_some(), echo),
            ticket,
            abort,
        ))
    } else {
        let mut abort = abort;
        tokio::select! {
            r = whole_response(
                header,
                choices,
                &mut log,
                (n_choices, job.params.n),
                prompt_tokens,
                (job.params.logprobs.is_some(), echo),
                ticket,
            ) => r,
            _ = aborted(&mut abort) => Err(shut_down()),
        }
    }
}

/// `(n, per_prompt)`: the choices in all, and per prompt; `echo`: a Responses request's fields
/// (its answer is a response object).
async fn whole_response(
    header: Header,
    mut choices: SelectAll<BoxStream<'static, ChoiceOut>>,
    log: &mut RequestLog,
    (n, per_prompt): (usize, usize),
    prompt_tokens: usize,
    (logprobs, echo): (bool, Option<Arc<crate::responses::Echo>>),
    mut ticket: Option<Ticket>,
) -> Result<Response, ApiError> {
    let mut text = vec![String::new(); n];
    let mut lps: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
    let mut finish = vec![String::from("stop"); n];
    let mut calls: Vec<Option<Vec<crate::tools::Call>>> = vec![None; n];
    // the thought of each choice, when the text is split (`--reasoning-format`)
    let mut reasoning: Vec<Option<String>> = vec![None; n];
    let (mut completion_tokens, mut reasoning_tokens) = (0, 0);
    let mut cached = 0;
    while let Some(out) = choices.next().await {
        drop(ticket.take()); // running now
        log.token();
        match out {
            ChoiceOut::Delta {
                index,
                text: t,
                logprobs: l,
            } => {
                text[index].push_str(&t);
                lps[index].extend(l);
            }
            ChoiceOut::Finish {
                index,
                logprobs: l,
                reason,
                completion_tokens: c,
                reasoning_tokens: rt,
                cached_tokens,
                tool_calls,
            } => {
                calls[index] = tool_calls;
                lps[index].extend(l);
                finish[index] = reason.to_owned();
                log.finish[index] = reason;
                completion_tokens += c;
                reasoning_tokens += rt;
                if index % per_prompt.max(1) == 0 {
                    cached += cached_tokens;
                }
            }
            ChoiceOut::ToolCall { .. } => {} // the calls come whole with the Finish
            ChoiceOut::Reasoning { index, text } => reasoning[index]
                .get_or_insert_with(String::new)
                .push_str(&text),
            ChoiceOut::Error { error, .. } => {
                log.end("error");
                return Err(error);
            }
        }
    }
    let usage = Usage {
        prompt_tokens,
        completion_tokens,
        cached_tokens: cached,
        reasoning_tokens,
    };
    // The body is built and serialized on a blocking thread: with logprobs it can hold hundreds of
    // thousands of entries (n x max_tokens x top_logprobs), tens of milliseconds of CPU that must
    // not stall an async worker (and /health with it).
    let json = tokio::task::spawn_blocking(move || {
        if let Some(echo) = &echo {
            // one choice: Responses requests have no `n`
            let r = echo.response(
                &header,
                reasoning[0].as_deref(),
                &text[0],
                &finish[0],
                calls[0].as_deref(),
                usage,
            );
            return serde_json::to_vec(&r);
        }
        let out: Vec<sse::ChoiceBody> = text
            .into_iter()
            .zip(lps)
            .zip(finish)
            .zip(calls)
            .zip(reasoning)
            .map(|((((t, l), f), c), r)| sse::ChoiceBody {
                reasoning: r,
                text: t,
                logprobs: logprobs.then(|| sse::logprobs_json(header.kind, &l, 0)),
                finish: f,
                tool_calls: c.map(|c| sse::tool_calls_json(&header.id, &c)),
            })
            .collect();
        serde_json::to_vec(&header.full(out, usage))
    })
    .await
    .map_err(|e| ApiError::internal(format!("building the response failed: {e}")))?
    .map_err(|e| ApiError::internal(format!("cannot serialize the response: {e}")))?;
    log.usage = usage;
    log.end("ok");
    Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response())
}

struct StreamState {
    header: Header,
    choices: SelectAll<BoxStream<'static, ChoiceOut>>,
    queue: VecDeque<Bytes>,
    usage: Usage,
    logprobs: bool,
    /// Characters sent so far per choice (completion logprobs' text_offset).
    sent_chars: Vec<usize>,
    /// Choices per prompt (`n`).
    per_prompt: usize,
    log: RequestLog,
    finished: bool,
    abort: watch::Receiver<bool>,
    ticket: Option<Ticket>,
    /// A Responses stream's typed events (`crate::responses`), else chat/completion chunks.
    events: Option<crate::responses::Events>,
}

impl StreamState {
    fn emit(&mut self, index: usize, text: &str, lps: &[TokenLogprob], finish: Option<&str>) {
        let lp = (self.logprobs && (!lps.is_empty() || finish.is_none()))
            .then(|| sse::logprobs_json(self.header.kind, lps, self.sent_chars[index]));
        self.sent_chars[index] += text.chars().count();
        let chunk = self.header.chunk(index, false, text, lp, finish);
        self.queue.push_back(sse::data(&chunk));
    }

    fn handle(&mut self, out: ChoiceOut) {
        self.ticket = None; // running now
        self.log.token();
        if self.events.is_some() {
            return self.handle_responses(out);
        }
        match out {
            ChoiceOut::Delta {
                index,
                text,
                logprobs,
            } => self.emit(index, &text, &logprobs, None),
            ChoiceOut::Finish {
                index,
                logprobs,
                reason,
                completion_tokens,
                reasoning_tokens,
                cached_tokens,
                tool_calls: _, // streamed piece by piece as they came
            } => {
                self.usage.completion_tokens += completion_tokens;
                self.usage.reasoning_tokens += reasoning_tokens;
                if index % self.per_prompt.max(1) == 0 {
                    self.usage.cached_tokens += cached_tokens;
                }
                self.log.finish[index] = reason;
                if !logprobs.is_empty() {
                    self.emit(index, "", &logprobs, None);
                }
                self.emit(index, "", &[], Some(reason));
            }
            ChoiceOut::Reasoning { index, text } => {
                let chunk = self.header.reasoning_chunk(index, &text);
                self.queue.push_back(sse::data(&chunk));
            }
            ChoiceOut::ToolCall { index, event } => {
                let delta = sse::tool_call_delta(&self.header.id, &event);
                let chunk = self.header.tool_calls_chunk(index, delta);
                self.queue.push_back(sse::data(&chunk));
            }
            ChoiceOut::Error { error, .. } => {
                // Headers are gone: report in-band, then end the stream.
                self.queue.push_back(sse::data(&error.to_json()));
                self.log.usage = self.usage;
                self.log.end("error");
                self.close();
            }
        }
    }

    /// [`Self::handle`] for a Responses stream: its typed events.
    fn handle_responses(&mut self, out: ChoiceOut) {
        let ev = self.events.as_mut().expect("a Responses stream");
        let frames = match out {
            ChoiceOut::Delta { text, .. } => ev.text(&text),
            // the thought as a reasoning item, before the message
            ChoiceOut::Reasoning { text, .. } => ev.reasoning(&text),
            ChoiceOut::ToolCall { event, .. } => ev.tool(&event),
            ChoiceOut::Finish {
                reason,
                completion_tokens,
                reasoning_tokens,
                cached_tokens,
                ..
            } => {
                self.usage.completion_tokens += completion_tokens;
                self.usage.reasoning_tokens += reasoning_tokens;
                self.usage.cached_tokens += cached_tokens;
                self.log.finish[0] = reason;
                ev.finish(reason);
                Vec::new()
            }
            ChoiceOut::Error { error, .. } => {
                let frames = ev.error(&error);
                self.queue.extend(frames);
                self.log.usage = self.usage;
                self.log.end("error");
                self.finished = true;
                return;
            }
        };
        self.queue.extend(frames);
    }

    fn close(&mut self) {
        self.log.usage = self.usage;
        self.log.end("ok");
        if let Some(ev) = self.events.as_mut() {
            // the response's last event; a Responses stream has no [DONE]
            let frames = ev.end(self.usage);
            self.queue.extend(frames);
            self.finished = true;
            return;
        }
        if self.header.include_usage {
            let u = self.header.usage_chunk(self.usage);
            self.queue.push_back(sse::data(&u));
        }
        self.queue.push_back(Bytes::from_static(sse::DONE));
        self.finished = true;
    }
}

/// `log` carries the prompt tokens (its usage so far).
fn stream_response(
    header: Header,
    choices: SelectAll<BoxStream<'static, ChoiceOut>>,
    (served_keepalive, log): (Option<std::time::Duration>, RequestLog),
    (n, per_prompt): (usize, usize),
    (logprobs, echo): (bool, Option<Arc<crate::responses::Echo>>),
    ticket: Option<Ticket>,
    abort: watch::Receiver<bool>,
) -> Response {
    let keepalive = served_keepalive;
    let events = echo.map(|e| crate::responses::Events::new(header.clone(), e));
    let mut st = StreamState {
        events,
        abort,
        ticket,
        queue: VecDeque::new(),
        choices,
        usage: Usage {
            prompt_tokens: log.usage.prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            reasoning_tokens: 0,
        },
        logprobs,
        sent_chars: vec![0; n],
        per_prompt,
        log,
        finished: false,
        header,
    };
    // A Responses stream opens with response.created and response.in_progress.
    if let Some(ev) = st.events.as_mut() {
        let frames = ev.start();
        st.queue.extend(frames);
    }
    // Every choice opens with its role chunk (chat) so the first delta of each carries the role.
    if st.header.kind == Kind::Chat {
        for i in 0..n {
            let c = st.header.chunk(i, true, "", None, None);
            st.queue.push_back(sse::data(&c));
        }
    }
    let body = stream::unfold(
        (st, tokio::time::Instant::now()),
        move |(mut st, mut sent)| async move {
            loop {
                if let Some(b) = st.queue.pop_front() {
                    return Some((
                        Ok::<Bytes, Infallible>(b),
                        (st, tokio::time::Instant::now()),
                    ));
                }
                if st.finished {
                    return None;
                }
                // a comment after `keepalive` of silence (a long prefill, a wait for a slot)
                let quiet = async {
                    match keepalive {
                        Some(k) => tokio::time::sleep_until(sent + k).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    out = st.choices.next() => match out {
                        Some(out) => st.handle(out),
                        None => st.close(),
                    },
                    _ = quiet => {
                        sent = tokio::time::Instant::now();
                        return Some((Ok(Bytes::from_static(sse::KEEPALIVE)), (st, sent)));
                    }
                    _ = aborted(&mut st.abort) => {
                        // Dropping the choices cancels their sequences in the engine.
                        st.choices = SelectAll::new();
                        st.handle(ChoiceOut::Error { error: shut_down() });
                    }
                }
            }
        },
    );
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_long_names_both_counts_and_is_400() {
        let e = submit_error(SubmitError::PromptTooLong {
            prompt: 9000,
            capacity: 8192,
        });
        assert_eq!(e.status, 400);
        assert!(
            e.message.contains("9000") && e.message.contains("8192"),
            "{}",
            e.message
        );
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert_eq!(submit_error(SubmitError::EmptyPrompt).status, 400);
        assert_eq!(submit_error(SubmitError::Stopped("x".into())).status, 503);
    }
}
