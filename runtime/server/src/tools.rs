//! Tool calling (the OpenAI API's `tools`, `tool_choice`, `parallel_tool_calls`): the request's
//! tools go to the chat template (`tools`); the model's answer is parsed back into `tool_calls` in
//! the target's syntax ([`ToolFormat`], MODEL.toml `[behavior] tool_call_format`); a `required` or
//! named choice is enforced with a grammar (`crate::grammar`), so the call always parses.
//!
//! Formats:
//! - `hermes` (Hermes, Qwen, SmolLM-style ChatML models): `<tool_call>\n{"name": ..., "arguments":
//!   {...}}\n</tool_call>`, one block per call;
//! - `llama3_json` (Llama 3.1+): the answer is one JSON object `{"name": ..., "parameters": {...}}`
//!   (several separated by `;` when parallel calls are allowed).
//!
//! With tools offered and a choice other than `none`, a choice's text goes through [`ToolStream`]:
//! plain text streams as content at once (only a possible start of a call is held back); a call
//! streams as `tool_calls` deltas, its name first and then its arguments piece by piece as the
//! model writes them (when it writes the name first, as the forced grammar does; otherwise the call
//! goes out whole once it closes). The finish reason is `tool_calls` when a call was made.

use llguidance::api::TopLevelGrammar;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

/// The syntax a target's model writes tool calls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
}

impl ToolFormat {
    /// MODEL.toml's `tool_call_format` (absent: hermes).
    pub fn parse(s: Option<&str>) -> Result<ToolFormat, String> {
        match s {
            None | Some("hermes") => Ok(ToolFormat::Hermes),
            Some("llama3_json") => Ok(ToolFormat::Llama3Json),
            Some(o) => Err(format!(
                "tool_call_format '{o}': expected hermes or llama3_json"
            )),
        }
    }

    /// The text the model writes for `calls` (an assistant message that carries only tool calls is
    /// rendered with it as its content, for templates that do not read `tool_calls`).
    pub fn render(self, calls: &[(String, String)]) -> String {
        let args = |a: &str| serde_json::from_str::<Value>(a).unwrap_or(json!({}));
        match self {
            ToolFormat::Hermes => calls
                .iter()
                .map(|(n, a)| {
                    format!(
                        "<tool_call>\n{}\n</tool_call>",
                        json!({"name": n, "arguments": args(a)})
                    )
                })
                .collect::<Vec<_>>()
                .join("\n"),
            ToolFormat::Llama3Json => calls
                .iter()
                .map(|(n, a)| json!({"name": n, "parameters": args(a)}).to_string())
                .collect::<Vec<_>>()
                .join("; "),
        }
    }
}

/// One function the client offers.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolIn {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionIn,
}

#[derive(Debug, Clone, Deserialize)]
pub struct FunctionIn {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Value>,
}

/// Which calls the model may or must make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    Auto,
    Required,
    Named(String),
}

/// A request's tools, validated (`None` when it offers none or chose `none`).
#[derive(Debug, Clone)]
pub struct Tools {
    pub list: Vec<ToolIn>,
    pub choice: Choice,
    pub parallel: bool,
    pub format: ToolFormat,
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments as a JSON text (the API's `function.arguments`).
    pub arguments: String,
}

impl Tools {
    /// Validate `tools`, `tool_choice` and `parallel_tool_calls`.
    pub fn from_request(
        tools: Option<&Vec<ToolIn>>,
        choice: Option<&Value>,
        parallel: Option<bool>,
        format: ToolFormat,
    ) -> Result<Option<Tools>, ApiError> {
        let list = match tools {
            Some(t) if !t.is_empty() => t.clone(),
            _ => {
                return match choice {
                    None => Ok(None),
                    Some(v) if v.is_null() || v == "none" || v == "auto" => Ok(None),
                    Some(_) => Err(ApiError::invalid(
                        "'tool_choice' needs 'tools' to choose from",
                        Some("tool_choice"),
                    )),
                }
            }
        };
        for (i, t) in list.iter().enumerate() {
            if t.kind != "function" {
                return Err(ApiError::invalid(
                    format!(
                        "tools[{i}].type '{}' is not supported (function only)",
                        t.kind
                    ),
                    Some(&format!("tools[{i}].type")),
                ));
            }
            let n = &t.function.name;
            if n.is_empty()
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name {n:?} must be letters, digits, _ or -"),
                    Some(&format!("tools[{i}].function.name")),
                ));
            }
            if list[..i].iter().any(|o| &o.function.name == n) {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name '{n}' is given twice"),
                    Some("tools"),
                ));
            }
            if let Some(p) = &t.function.parameters {
                if !p.is_object() {
                    return Err(ApiError::invalid(
                        format!("tools[{i}].function.parameters must be a JSON schema object"),
                        Some(&format!("tools[{i}].function.parameters")),
                    ));
                }
            }
        }
        let choice = match choice {
            None => Choice::Auto,
            Some(v) if v.is_null() || v == "auto" => Choice::Auto,
            Some(v) if v == "none" => return Ok(None),
            Some(v) if v == "required" => Choice::Required,
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(n) if list.iter().any(|t| t.function.name == n) => Choice::Named(n.into()),
                Some(n) => {
                    return Err(ApiError::invalid(
                        format!("tool_choice names '{n}', which is not among the tools"),
                        Some("tool_choice"),
                    ))
                }
                None => {
                    return Err(ApiError::invalid(
                        "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        Some("tool_choice"),
                    ))
                }
            },
        };
        Ok(Some(Tools {
            list,
            choice,
            parallel: parallel.unwrap_or(true),
            format,
        }))
    }

    /// The template's `tools` variable.
    pub fn template_value(&self) -> Value {
        Value::Array(
            self.list
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.function.name,
                        "description": t.function.description,
                        "parameters": t.function.parameters.clone().unwrap_or(json!({"type": "object"})),
                    }})
                })
                .collect(),
        )
    }

    /// The schema of one call of the tools `names` may name, in the format's field names. The
    /// arguments take no properties the tool does not declare unless its schema says otherwise
    /// (`additionalProperties`), as OpenAI's strict function calling does: a forced call stays
    /// bounded.
    fn call_schema(&self, names: &[&ToolIn]) -> Value {
        let args = match self.format {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3Json => "parameters",
        };
        let params = arguments_schema;
        let one = |t: &ToolIn| {
            json!({
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    args: params(t),
                },
                "required": ["name", args],
                "additionalProperties": false,
                "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
            })
        };
        if names.len() == 1 {
            one(names[0])
        } else {
            json!({"anyOf": names.iter().map(|t| one(t)).collect::<Vec<_>>(),
                   "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}})
        }
    }

    /// The tools a forced choice may call (`required`: any; named: that one); `None` for `auto`.
    fn forced(&self) -> Option<Vec<&ToolIn>> {
        match &self.choice {
            Choice::Auto => None,
            Choice::Required => Some(self.list.iter().collect()),
            Choice::Named(n) => Some(self.list.iter().filter(|t| &t.function.name == n).collect()),
        }
    }

    /// A grammar that forces one call as a harmony message (gpt-oss, `crate::harmony`):
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`, ARGS
    /// the tool's parameters as JSON; `None` for `auto`.
    pub fn harmony_grammar(&self) -> Option<TopLevelGrammar> {
        let calls: Vec<String> = self
            .forced()?
            .iter()
            .map(|t| {
                // compact JSON, as the other formats' forced calls
                let mut args = arguments_schema(t);
                if let Some(o) = args.as_object_mut() {
                    o.insert(
                        "x-guidance".into(),
                        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                    );
                }
                format!(
                    "<|channel|> \"commentary to=functions.{} \" <|constrain|> \"json\" <|message|> %json {args} <|call|>",
                    t.function.name,
                )
            })
            .collect();
        Some(TopLevelGrammar::from_lark(format!(
            "start: {}\n",
            calls.join(" | ")
        )))
    }

    /// A grammar that forces calls (`required`: any of the tools; named: that one), else `None`.
    pub fn grammar(&self) -> Option<TopLevelGrammar> {
        let names = self.forced()?;
        let schema = self.call_schema(&names);
        let many = if self.parallel { "+" } else { "" };
        let lark = match self.format {
            ToolFormat::Hermes => format!(
                "start: call{many}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"
            ),
            ToolFormat::Llama3Json if self.parallel => {
                format!("start: body (\"; \" body)*\nbody: %json {schema}\n")
            }
            ToolFormat::Llama3Json => format!("start: body\nbody: %json {schema}\n"),
        };
        Some(TopLevelGrammar::from_lark(lark))
    }
}

/// A tool's parameters schema as a forced call's arguments: no properties the tool does not
/// declare unless its schema says otherwise (`additionalProperties`), as OpenAI's strict function
/// calling does, so a forced call stays bounded.
fn arguments_schema(t: &ToolIn) -> Value {
    let mut p = t
        .function
        .parameters
        .clone()
        .unwrap_or(json!({"type": "object"}));
    if let Some(o) = p.as_object_mut() {
        o.entry("additionalProperties").or_insert(json!(false));
    }
    p
}

/// What [`ToolStream`] makes of the text so far, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    /// Text for the message's `content`.
    Text(String),
    /// Call `index` (of this choice) begins: the function's name.
    Start { index: usize, name: String },
    /// More of call `index`'s arguments (JSON text; the pieces of a call concatenate to it).
    Args { index: usize, text: String },
}

/// Where [`ToolStream`] is in the text (offsets are into all the text so far).
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing but whitespace or a possible start of a call yet.
    Undecided,
    /// Content (hermes: a call may still start later).
    Text,
    /// In the calls part, before the next call's opening.
    Between,
    /// Call `index` (its object at `obj`) has its name sent and its arguments (from `args`)
    /// streaming; `sent` bytes of them so far.
    Args {
        index: usize,
        obj: usize,
        args: usize,
        sent: usize,
        scan: JsonScan,
    },
    /// The call object at `obj` must close (hermes: and its tag); `index`: the call, if it streamed.
    Close {
        obj: usize,
        index: Option<usize>,
        scan: JsonScan,
    },
}

/// The streaming reader of one choice's text with tools offered (module docs). Feed it the text
/// as it comes ([`ToolStream::push`]), then [`ToolStream::finish`].
///
/// Invariant: `all[..pos]` has been sent as content or read as complete calls; nothing is lost:
/// what does not read as calls ends up as content.
pub struct ToolStream {
    tools: std::sync::Arc<Tools>,
    all: String,
    state: State,
    pos: usize,
    calls: Vec<Call>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";

/// `t` is a proper beginning of `lit` (more text may complete it).
fn partial(t: &str, lit: &str) -> bool {
    t.len() < lit.len() && lit.starts_with(t)
}

/// Where a JSON object or array starting at `s[0]` ends (one past its last byte), read as the text
/// grows: each call to [`JsonScan::end`] with the same text, longer, reads only what is new (a
/// streamed call's arguments are scanned once, not once per token).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct JsonScan {
    seen: usize,
    depth: usize,
    in_str: bool,
    esc: bool,
    found: Option<usize>,
}

impl JsonScan {
    /// The end of the value at `s[0]`, or `None` while `s` holds only part of it (or does not
    /// start with one).
    fn end(&mut self, s: &str) -> Option<usize> {
        if self.found.is_some() {
            return self.found;
        }
        let b = s.as_bytes();
        if self.seen == 0 && !matches!(b.first(), Some(b'{') | Some(b'[')) {
            return None;
        }
        for (i, &c) in b.iter().enumerate().skip(self.seen) {
            if self.in_str {
                match c {
                    _ if self.esc => self.esc = false,
                    b'\\' => self.esc = true,
                    b'"' => self.in_str = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => self.in_str = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        self.found = Some(i + 1);
                        return self.found;
                    }
                }
                _ => {}
            }
        }
        self.seen = b.len();
        None
    }
}

/// The start of a call written name first: `{"name": "NAME", "arguments": ` (or "parameters"),
/// any whitespace between tokens. `Ok(Some((name, offset of the arguments)))` once the first
/// character of the arguments is there, `Ok(None)` when `s` may still become one, `Err(())` when
/// it cannot.
fn call_head(s: &str) -> Result<Option<(String, usize)>, ()> {
    let b = s.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    // Ok(true): matched and consumed; Ok(false): the text ends inside it
    let lit = |i: &mut usize, l: &str| -> Result<bool, ()> {
        let rest = &s[*i..];
        if rest.starts_with(l) {
            *i += l.len();
            Ok(true)
        } else if partial(rest, l) {
            Ok(false)
        } else {
            Err(())
        }
    };
    for l in ["{", "\"name\"", ":", "\""] {
        ws(&mut i);
        if !lit(&mut i, l)? {
            return Ok(None);
        }
    }
    let Some(len) = s[i..].find('"') else {
        return Ok(None);
    };
    let name = s[i..i + len].to_string();
    if name.contains('\\') {
        return Err(()); // tool names are [A-Za-z0-9_-]: no escapes
    }
    i += len + 1;
    ws(&mut i);
    if !lit(&mut i, ",")? {
        return Ok(None);
    }
    ws(&mut i);
    let rest = &s[i..];
    let key = ["\"arguments\"", "\"parameters\""]
        .into_iter()
        .find(|k| rest.starts_with(k) || partial(rest, k))
        .ok_or(())?;
    for l in [key, ":"] {
        ws(&mut i);
        if !lit(&mut i, l)? {
            return Ok(None);
        }
    }
    ws(&mut i);
    Ok((i < s.len()).then_some((name, i)))
}

impl ToolStream {
    pub fn new(tools: std::sync::Arc<Tools>) -> ToolStream {
        ToolStream {
            tools,
            all: String::new(),
            state: State::Undecided,
            pos: 0,
            calls: Vec::new(),
        }
    }

    fn hermes(&self) -> bool {
        self.tools.format == ToolFormat::Hermes
    }

    fn known(&self, name: &str) -> bool {
        self.tools.list.iter().any(|t| t.function.name == name)
    }

    /// Take in `text`; the events it completes.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.all.push_str(text);
        let mut ev = Vec::new();
        while self.step(&mut ev) {}
        ev
    }

    /// The text is complete: the last events, and the calls made (`None` if none was). A call the
    /// text cut short keeps the arguments it streamed.
    pub fn finish(mut self) -> (Vec<ToolEvent>, Option<Vec<Call>>) {
        let mut ev = Vec::new();
        while self.step(&mut ev) {}
        let rest = &self.all[self.pos..];
        match self.state {
            State::Args { index, args, .. } => {
                self.calls[index].arguments = self.all[args..].to_string();
            }
            State::Close { index: Some(_), .. } => {}
            _ if !rest.trim().is_empty() || (self.state == State::Text && !rest.is_empty()) => {
                ev.push(ToolEvent::Text(rest.to_string()));
            }
            _ => {}
        }
        let calls = (!self.calls.is_empty()).then_some(self.calls);
        (ev, calls)
    }

    /// What was read as a possible call, up to `upto`, is content after all.
    fn fall_back_to_text(&mut self, upto: usize, ev: &mut Vec<ToolEvent>) {
        ev.push(ToolEvent::Text(self.all[self.pos..upto].to_string()));
        self.pos = upto;
        self.state = State::Text;
    }

    fn start_call(&mut self, name: String, ev: &mut Vec<ToolEvent>) -> usize {
        let index = self.calls.len();
        ev.push(ToolEvent::Start {
            index,
            name: name.clone(),
        });
        self.calls.push(Call {
            name,
            arguments: String::new(),
        });
        index
    }

    /// One step of reading; `false` when more text is needed.
    fn step(&mut self, ev: &mut Vec<ToolEvent>) -> bool {
        let rest = &self.all[self.pos..];
        match self.state {
            State::Undecided => {
                let t = rest.trim_start();
                let call = match self.tools.format {
                    _ if t.is_empty() => return false,
                    ToolFormat::Hermes if partial(t, HERMES_OPEN) => return false,
                    ToolFormat::Hermes => t.starts_with(HERMES_OPEN),
                    ToolFormat::Llama3Json => t.starts_with('{'),
                };
                self.state = if call { State::Between } else { State::Text };
                true
            }
            State::Text => {
                let (send, tag) = if !self.hermes() {
                    (rest.len(), false)
                } else if let Some(k) = rest.find(HERMES_OPEN) {
                    (k, true)
                } else {
                    // keep back an end that could begin the tag
                    let keep = (1..HERMES_OPEN.len().min(rest.len() + 1))
                        .rev()
                        .find(|&n| {
                            rest.is_char_boundary(rest.len() - n)
                                && HERMES_OPEN.starts_with(&rest[rest.len() - n..])
                        })
                        .unwrap_or(0);
                    (rest.len() - keep, false)
                };
                if send > 0 {
                    ev.push(ToolEvent::Text(rest[..send].to_string()));
                    self.pos += send;
                }
                if tag {
                    self.state = State::Between;
                }
                send > 0 || tag
            }
            State::Between => {
                let mut t = rest.trim_start();
                if !self.hermes() {
                    if let Some(r) = t.strip_prefix(';') {
                        t = r.trim_start(); // between llama3_json calls
                    }
                }
                if t.is_empty() || (self.hermes() && partial(t, HERMES_OPEN)) {
                    return false;
                }
                let body = if self.hermes() {
                    match t.strip_prefix(HERMES_OPEN) {
                        Some(b) => b.trim_start(),
                        None => {
                            self.state = State::Text; // content after the calls
                            return true;
                        }
                    }
                } else {
                    t
                };
                if body.is_empty() {
                    return false;
                }
                if !body.starts_with('{') {
                    // a tag or text that is not a call object: content, the tag included
                    let upto = self.all.len() - body.len();
                    self.fall_back_to_text(upto, ev);
                    return true;
                }
                let obj = self.all.len() - body.len();
                match call_head(body) {
                    Ok(None) => false,
                    Ok(Some((name, off)))
                        if self.known(&name) && body[off..].starts_with(['{', '[']) =>
                    {
                        let index = self.start_call(name, ev);
                        self.state = State::Args {
                            index,
                            obj,
                            args: obj + off,
                            sent: 0,
                            scan: JsonScan::default(),
                        };
                        true
                    }
                    _ => {
                        // not name first (or not a known tool): read it whole once it closes
                        self.state = State::Close {
                            obj,
                            index: None,
                            scan: JsonScan::default(),
                        };
                        true
                    }
                }
            }
            State::Args {
                index,
                obj,
                args,
                sent,
                mut scan,
            } => {
                let a = &self.all[args..];
                let (upto, done) = match scan.end(a) {
                    Some(end) => (end, true),
                    None => (a.len(), false),
                };
                if upto > sent {
                    ev.push(ToolEvent::Args {
                        index,
                        text: a[sent..upto].to_string(),
                    });
                }
                if done {
                    self.calls[index].arguments = a[..upto].to_string();
                    self.state = State::Close {
                        obj,
                        index: Some(index),
                        scan: JsonScan::default(),
                    };
                    return true;
                }
                self.state = State::Args {
                    index,
                    obj,
                    args,
                    sent: upto,
                    scan,
                };
                upto > sent
            }
            State::Close {
                obj,
                index,
                mut scan,
            } => {
                let body = &self.all[obj..];
                let end = scan.end(body);
                self.state = State::Close { obj, index, scan };
                let Some(end) = end else {
                    return false;
                };
                let after = body[end..].trim_start();
                let close_end = if self.hermes() {
                    if partial(after, HERMES_CLOSE) {
                        return false; // the closing tag may be coming
                    }
                    match after.strip_prefix(HERMES_CLOSE) {
                        Some(r) => self.all.len() - r.len(),
                        None => obj + end, // no closing tag: the object alone
                    }
                } else {
                    obj + end
                };
                if index.is_none() {
                    let v: Option<Value> = serde_json::from_str(&body[..end]).ok();
                    let call = v.and_then(|v| {
                        let name = v.get("name")?.as_str()?.to_string();
                        let a = v.get("arguments").or_else(|| v.get("parameters"))?;
                        Some((name, a.to_string()))
                    });
                    match call {
                        Some((name, args)) if self.known(&name) => {
                            let i = self.start_call(name, ev);
                            ev.push(ToolEvent::Args {
                                index: i,
                                text: args.clone(),
                            });
                            self.calls[i].arguments = args;
                        }
                        _ => {
                            self.fall_back_to_text(close_end, ev); // not a call: content
                            return true;
                        }
                    }
                }
                self.pos = close_end;
                self.state = State::Between;
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(format: ToolFormat) -> Tools {
        let list: Vec<ToolIn> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
              "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
        ]))
        .unwrap();
        Tools::from_request(Some(&list), None, None, format)
            .unwrap()
            .unwrap()
    }

    /// The calls `text` makes read whole by the server's reader, or `None` when it is not (only)
    /// tool calls.
    fn parse(t: &Tools, text: &str) -> Option<Vec<Call>> {
        let mut ts = ToolStream::new(std::sync::Arc::new(t.clone()));
        let mut ev = ts.push(text);
        let (last, calls) = ts.finish();
        ev.extend(last);
        let content = ev
            .iter()
            .any(|e| matches!(e, ToolEvent::Text(x) if !x.trim().is_empty()));
        if content {
            None
        } else {
            calls
        }
    }

    #[test]
    fn both_formats_parse_what_they_render() {
        for f in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
            let t = tools(f);
            let calls = vec![
                ("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string()),
                ("add".to_string(), r#"{"a":1,"b":2}"#.to_string()),
            ];
            let text = f.render(&calls);
            let got = parse(&t, &text).unwrap_or_else(|| panic!("{f:?}: {text}"));
            assert_eq!(got.len(), 2, "{text}");
            assert_eq!(got[0].name, "get_weather");
            assert_eq!(
                serde_json::from_str::<Value>(&got[0].arguments).unwrap(),
                json!({"city": "Paris"})
            );
            assert_eq!(got[1].name, "add");
            // text that is not calls
            assert!(parse(&t, "The weather is fine.").is_none());
            assert!(parse(&t, &text.replace("get_weather", "unknown_fn")).is_none());
        }
    }

    #[test]
    fn choices_validate() {
        let list: Vec<ToolIn> =
            serde_json::from_value(json!([{"type": "function", "function": {"name": "f"}}]))
                .unwrap();
        let f = ToolFormat::Hermes;
        assert!(
            Tools::from_request(Some(&list), Some(&json!("none")), None, f)
                .unwrap()
                .is_none()
        );
        let t = Tools::from_request(Some(&list), Some(&json!("required")), Some(false), f)
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, Choice::Required);
        assert!(t.grammar().is_some());
        let named = json!({"type": "function", "function": {"name": "g"}});
        let e = Tools::from_request(Some(&list), Some(&named), None, f).unwrap_err();
        assert!(
            e.message.contains("'g', which is not among the tools"),
            "{}",
            e.message
        );
        assert!(Tools::from_request(None, Some(&json!("required")), None, f).is_err());
    }

    /// What a fed ToolStream produced: the content, the calls (name, arguments) as its events
    /// built them, the calls `finish` returned, and the number of argument events.
    type Fed = (String, Vec<(String, String)>, Option<Vec<Call>>, usize);

    /// Feed `text` to a ToolStream in pieces of `chunk` characters (0: whole).
    fn stream(f: ToolFormat, text: &str, chunk: usize) -> Fed {
        let mut ts = ToolStream::new(std::sync::Arc::new(tools(f)));
        let chars: Vec<char> = text.chars().collect();
        let pieces: Vec<String> = if chunk == 0 {
            vec![text.to_string()]
        } else {
            chars.chunks(chunk).map(|c| c.iter().collect()).collect()
        };
        let mut ev = Vec::new();
        for p in &pieces {
            ev.extend(ts.push(p));
        }
        let (last, calls) = ts.finish();
        ev.extend(last);
        let (mut content, mut built, mut arg_events) =
            (String::new(), Vec::<(String, String)>::new(), 0);
        for e in ev {
            match e {
                ToolEvent::Text(t) => content.push_str(&t),
                ToolEvent::Start { index, name } => {
                    assert_eq!(index, built.len(), "calls start in order");
                    built.push((name, String::new()));
                }
                ToolEvent::Args { index, text } => {
                    built[index].1.push_str(&text);
                    arg_events += 1;
                }
            }
        }
        (content, built, calls, arg_events)
    }

    /// Every chunking gives the same content and calls; returns them (and the args events of a
    /// one-character feed).
    fn stream_all(f: ToolFormat, text: &str) -> (String, Vec<(String, String)>, usize) {
        let (c0, b0, k0, _) = stream(f, text, 0);
        for chunk in [1, 2, 3, 7] {
            let (c, b, k, _) = stream(f, text, chunk);
            assert_eq!((&c, &b, &k), (&c0, &b0, &k0), "chunks of {chunk}: {text:?}");
        }
        let from_finish: Vec<(String, String)> = k0
            .unwrap_or_default()
            .into_iter()
            .map(|c| (c.name, c.arguments))
            .collect();
        assert_eq!(from_finish, b0, "finish's calls are the streamed ones");
        (c0, b0, stream(f, text, 1).3)
    }

    /// The resumable scan finds the same end fed a byte at a time as fed whole: braces and
    /// brackets inside strings, escaped quotes and backslashes do not count.
    #[test]
    fn json_scan_resumes_where_it_stopped() {
        let v = r#"{"a": "}{ \" \\", "b": [1, {"c": "]"}], "d": "x\\"} trailing"#;
        let whole = JsonScan::default().end(v);
        assert_eq!(whole, Some(v.find(" trailing").unwrap()));
        let mut scan = JsonScan::default();
        let mut got = None;
        for n in 0..=v.len() {
            got = scan.end(&v[..n]);
            if n < whole.unwrap() {
                assert_eq!(got, None, "ended early at {n}");
            }
        }
        assert_eq!(got, whole);
        assert_eq!(JsonScan::default().end("x{}"), None);
        assert_eq!(JsonScan::default().end("[[]"), None);
    }

    #[test]
    fn streamed_calls_send_the_name_then_the_arguments_piece_by_piece() {
        let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris \\\"x\\\" {\"}}\n</tool_call>";
        let (content, calls, arg_events) = stream_all(ToolFormat::Hermes, one);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![("get_weather".into(), r#"{"city": "Pa}ris \"x\" {"}"#.into())]
        );
        assert!(
            arg_events > 10,
            "arguments streamed in pieces: {arg_events}"
        );
        // two calls, whitespace between
        let two = format!("{one}\n{}", one.replace("get_weather", "add"));
        let (content, calls, _) = stream_all(ToolFormat::Hermes, &two);
        assert_eq!(content, "");
        assert_eq!(
            calls.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
            ["get_weather", "add"]
        );
        // llama3_json, parallel calls separated by ';'
        let l = r#"{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": [1, 2]}}"#;
        let (content, calls, arg_events) = stream_all(ToolFormat::Llama3Json, l);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![
                ("get_weather".into(), r#"{"city": "Paris"}"#.into()),
                ("add".into(), r#"{"a": [1, 2]}"#.into())
            ]
        );
        assert!(arg_events > 10);
    }

    #[test]
    fn text_streams_at_once_and_only_a_possible_call_start_is_held() {
        let f = ToolFormat::Hermes;
        let mut ts = ToolStream::new(std::sync::Arc::new(tools(f)));
        assert_eq!(
            ts.push("The weather "),
            vec![ToolEvent::Text("The weather ".into())]
        );
        assert_eq!(
            ts.push("is <to"),
            vec![ToolEvent::Text("is ".into())],
            "'<to' may open a call"
        );
        assert_eq!(
            ts.push("day> fine."),
            vec![ToolEvent::Text("<today> fine.".into())]
        );
        let (ev, calls) = ts.finish();
        assert!(ev.is_empty() && calls.is_none());
        // text, then a call
        let t = "Let me check.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>";
        let (content, calls, _) = stream_all(f, t);
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls, vec![("add".into(), "{}".into())]);
        // a partial tag at the very end is content
        let (content, calls, _) = stream_all(f, "x <tool_c");
        assert_eq!((content.as_str(), calls.len()), ("x <tool_c", 0));
        // llama3_json: text that does not open with '{', and JSON that is not a call
        for t in [
            "It is sunny.",
            r#"{"answer": 42}"#,
            r#"{"name": "unknown_fn", "parameters": {}}"#,
        ] {
            let (content, calls, _) = stream_all(ToolFormat::Llama3Json, t);
            assert_eq!((content.as_str(), calls.len()), (t, 0), "{t}");
        }
    }

    #[test]
    fn calls_not_written_name_first_go_out_whole_and_bad_ones_are_content() {
        let f = ToolFormat::Hermes;
        let t = "<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"add\"}\n</tool_call>";
        let (content, calls, arg_events) = stream_all(f, t);
        assert_eq!(content, "");
        assert_eq!(calls, vec![("add".into(), r#"{"a":1}"#.into())]);
        assert_eq!(arg_events, 1, "one piece: the whole arguments");
        for bad in [
            "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\nnot json\n</tool_call>",
        ] {
            let (content, calls, _) = stream_all(f, bad);
            assert_eq!((content.as_str(), calls.len()), (bad, 0), "{bad}");
        }
        // content after the calls is kept
        let t = "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\nDone.";
        let (content, calls, _) = stream_all(f, t);
        assert_eq!((content.as_str(), calls.len()), ("\nDone.", 1));
    }

    #[test]
    fn a_call_cut_short_keeps_the_arguments_it_streamed() {
        let t = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par";
        let (content, calls, finished, _) = stream(ToolFormat::Hermes, t, 1);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![("get_weather".into(), r#"{"city": "Par"#.into())]
        );
        assert_eq!(finished.unwrap()[0].arguments, r#"{"city": "Par"#);
    }
}
