//! Chat templates: a model's Jinja template rendered with minijinja.
//!
//! Owns: compiling a template once ([`ChatTemplate::new`]), finding it in a GGUF file
//! (`tokenizer.chat_template`) or an HF directory (`chat_template.jinja`, else `tokenizer_config.json`'s
//! `chat_template`, a string or a list of named templates), and rendering a conversation.
//!
//! The environment matches transformers' `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on,
//! loop controls (`break`/`continue`), Python string/dict/list methods through minijinja-contrib's
//! pycompat (`.strip()`, `.startswith()`, `.items()`...), `raise_exception(msg)` failing the render with
//! the template's message, `strftime_now(fmt)`, and the variables `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, and `tools` when the request offers tools (a message's `tool_calls`,
//! `tool_call_id` and `name` pass through as structured data, as transformers passes them).
//!
//! Rendering is bounded ([`RenderLimits`]): a template gets a fixed number of VM instructions
//! (minijinja's fuel) and its output a byte cap, so a template with runaway loops, from a model file
//! or `--chat-template`, fails that one render with [`RenderError`] instead of holding a thread.

use crate::error::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls (`[{id, type, function: {name, arguments}}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    limits: RenderLimits,
}

/// What one render may cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderLimits {
    /// VM instructions (minijinja fuel); a chat template spends tens per message.
    pub fuel: u64,
    /// Bytes of rendered text.
    pub max_bytes: usize,
}

impl Default for RenderLimits {
    /// Generous bounds for callers that set none (tests, tools): ten million instructions, 64 MiB.
    fn default() -> Self {
        RenderLimits {
            fuel: 10_000_000,
            max_bytes: 64 << 20,
        }
    }
}

/// Why a render failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("the chat template ran past its limit of {fuel} instructions")]
    OutOfFuel { fuel: u64 },
    #[error("the rendered prompt is longer than {max_bytes} bytes")]
    TooLong { max_bytes: usize },
    /// The template failed (e.g. its own `raise_exception`), with its message.
    #[error("{0}")]
    Template(String),
}

/// An `io::Write` into a String that fails past `max` bytes (minijinja writes output as it goes,
/// so a runaway template stops at the cap instead of after filling memory).
struct CappedWriter {
    out: Vec<u8>,
    max: usize,
    over: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            self.over = true;
            return Err(std::io::Error::other("output cap reached"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn terr(e: impl std::fmt::Display) -> ModelError {
    ModelError::Template { msg: e.to_string() }
}

fn strftime_now(fmt: String) -> std::result::Result<String, minijinja::Error> {
    // Templates use it for "today's date" in system prompts. Formatting without a time crate: support
    // the directives templates use (%d %m %Y %B %b %y %H %M %S); anything else is kept verbatim.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86400);
    let tod = secs.rem_euclid(86400);
    // civil_from_days (Howard Hinnant)
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{d:02}"),
            Some('m') => out += &format!("{m:02}"),
            Some('Y') => out += &y.to_string(),
            Some('y') => out += &format!("{:02}", y % 100),
            Some('B') => out += month,
            Some('b') => out += &month[..3],
            Some('H') => out += &format!("{:02}", tod / 3600),
            Some('M') => out += &format!("{:02}", tod % 3600 / 60),
            Some('S') => out += &format!("{:02}", tod % 60),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    Ok(out)
}

impl ChatTemplate {
    /// Compile a template source. `bos_token`/`eos_token` are empty until [`ChatTemplate::with_tokens`].
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("raise_exception: {msg}"),
                ))
            },
        );
        env.add_function("strftime_now", strftime_now);
        let limits = RenderLimits::default();
        env.set_fuel(Some(limits.fuel));
        env.add_template_owned("chat", source.to_string())
            .map_err(terr)?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: String::new(),
            eos_token: String::new(),
            limits,
        })
    }

    /// Bound every later render by `limits`.
    pub fn with_limits(mut self, limits: RenderLimits) -> ChatTemplate {
        self.env.set_fuel(Some(limits.fuel));
        self.limits = limits;
        self
    }

    /// The bounds renders run under.
    pub fn limits(&self) -> RenderLimits {
        self.limits
    }

    /// Set the strings the template sees as `bos_token` and `eos_token`.
    pub fn with_tokens(
        mut self,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> ChatTemplate {
        self.bos_token = bos_token.into();
        self.eos_token = eos_token.into();
        self
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), if it has one.
    pub fn from_gguf(
        g: &crate::gguf::GgufFile,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Option<ChatTemplate>> {
        match g.opt_str("tokenizer.chat_template")? {
            None => Ok(None),
            Some(src) => Ok(Some(
                ChatTemplate::new(src)
                    .map_err(|e| {
                        terr(format!(
                            "{}: tokenizer.chat_template: {e}",
                            g.path.display()
                        ))
                    })?
                    .with_tokens(bos_token, eos_token),
            )),
        }
    }

    /// The template of an HF directory: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of `{name, template}` of which `default` is used).
    /// `bos_token`/`eos_token` are read from tokenizer_config.json.
    pub fn from_hf(dir: &Path) -> Result<Option<ChatTemplate>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match crate::files::read_if_exists(&cfg_path)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| ModelError::Malformed {
                path: cfg_path.clone(),
                field: "json".into(),
                msg: e.to_string(),
            })?,
            None => serde_json::Value::Null,
        };
        let tok = |k: &str| -> String {
            match cfg.get(k) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or("")
                    .to_string(),
                None => String::new(),
            }
        };
        let jinja_path = dir.join("chat_template.jinja");
        let src = match crate::files::regular_if_exists(&jinja_path)? {
            Some(_) => Some(crate::files::read_to_string(&jinja_path)?),
            None => match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                Some(other) => {
                    return Err(ModelError::Mismatch {
                        path: cfg_path,
                        field: "chat_template".into(),
                        expected: "a string or a list of {name, template}".into(),
                        got: other.to_string(),
                    })
                }
            },
        };
        match src {
            None => Ok(None),
            Some(s) => Ok(Some(
                ChatTemplate::new(&s)
                    .map_err(|e| terr(format!("{}: {e}", dir.display())))?
                    .with_tokens(tok("bos_token"), tok("eos_token")),
            )),
        }
    }

    /// Render a conversation to the prompt text. Errors carry the template's own message (e.g. from
    /// `raise_exception`) or the location of the failure; [`ChatTemplate::render_bounded`] tells the
    /// limits apart.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_bounded(messages, add_generation_prompt)
            .map_err(terr)
    }

    /// [`ChatTemplate::render`], with a failure that says which limit (if any) stopped it.
    pub fn render_bounded(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, RenderError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render_bounded`] with the request's tools (`[{type, function: {name,
    /// description, parameters}}]`) as the template's `tools` variable.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> std::result::Result<String, RenderError> {
        self.render_with_kwargs(messages, tools, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render_with_tools`] with a request's `chat_template_kwargs` (an object) as
    /// further variables (e.g. Qwen3's `enable_thinking`); they cannot replace the ones above.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
        add_generation_prompt: bool,
    ) -> std::result::Result<String, RenderError> {
        let extra = minijinja::Value::from_serialize(kwargs.cloned().unwrap_or_default());
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| RenderError::Template(e.to_string()))?;
        let mut w = CappedWriter {
            out: Vec::new(),
            max: self.limits.max_bytes,
            over: false,
        };
        let r = t.render_captured_to(
            minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                tools => tools,
                ..extra
            },
            &mut w,
        );
        match r {
            Ok(_) => String::from_utf8(w.out).map_err(|e| RenderError::Template(e.to_string())),
            Err(_) if w.over => Err(RenderError::TooLong {
                max_bytes: self.limits.max_bytes,
            }),
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(RenderError::OutOfFuel {
                fuel: self.limits.fuel,
            }),
            Err(e) => {
                let mut msg = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    msg += &format!(": {s}");
                    src = s.source();
                }
                Err(RenderError::Template(msg))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "  Be brief. "),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello"),
        ]
    }

    #[test]
    fn python_methods_loop_controls_and_tokens() {
        // expected output checked with python jinja2 3.1.6 (same settings, loopcontrols extension)
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}\
             {{ m.role.upper() }}:{{ m.content.strip() }}|{% if m.content.startswith('  ') %}indented|{% endif %}\
             {% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}",
        )
        .unwrap()
        .with_tokens("<s>", "</s>");
        assert_eq!(
            t.render(&msgs(), true).unwrap(),
            "<s>SYSTEM:Be brief.|indented|USER:Hi|</s>"
        );
        assert_eq!(
            t.render(&msgs(), false).unwrap(),
            "<s>SYSTEM:Be brief.|indented|USER:Hi|"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        // expected output checked with python jinja2 3.1.6 (trim_blocks, lstrip_blocks, loopcontrols)
        let t = ChatTemplate::new("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
            .unwrap();
        assert_eq!(t.render(&msgs()[1..2], false).unwrap(), "Hi\n");
    }

    #[test]
    fn raise_exception_reaches_the_caller() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}",
        )
        .unwrap();
        let e = t.render(&msgs(), true).unwrap_err().to_string();
        assert!(e.contains("Conversation must start with user"), "{e}");
    }

    #[test]
    fn syntax_errors_and_strftime() {
        assert!(ChatTemplate::new("{% if %}").is_err());
        let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d %B %%') }}").unwrap();
        let s = t.render(&[], false).unwrap();
        assert!(s.len() >= 14, "{s}");
        assert!(s.starts_with("20") && s.ends_with(" %"), "{s}");
    }

    #[test]
    fn runaway_templates_stop_at_their_limits() {
        let limits = RenderLimits {
            fuel: 100_000,
            max_bytes: 1000,
        };
        // Nested loops: 10^10 iterations unbounded; the fuel stops them.
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        )
        .unwrap()
        .with_limits(limits);
        let t0 = std::time::Instant::now();
        assert_eq!(
            t.render_bounded(&msgs(), true),
            Err(RenderError::OutOfFuel { fuel: 100_000 })
        );
        assert!(t0.elapsed().as_secs() < 5);
        // A big output stops at the byte cap, before it is built.
        let t = ChatTemplate::new("{% for m in messages %}{{ m.content * 100 }}{% endfor %}")
            .unwrap()
            .with_limits(limits);
        assert_eq!(
            t.render_bounded(&[ChatMessage::new("user", "0123456789a")], true),
            Err(RenderError::TooLong { max_bytes: 1000 })
        );
        assert_eq!(
            t.render_bounded(&[ChatMessage::new("user", "0")], true)
                .unwrap()
                .len(),
            100
        );
    }

    #[test]
    fn chatml_spends_little_fuel_per_message() {
        // The fuel a real template spends per message, so that servers can size their limit: ChatML
        // (SmolLM2, Qwen) with 1000 messages renders within 60 instructions per message.
        let chatml = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
                      {{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}\
                      {{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}\
                      {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let many: Vec<ChatMessage> = (0..1000)
            .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "hi"))
            .collect();
        let t = ChatTemplate::new(chatml)
            .unwrap()
            .with_limits(RenderLimits {
                fuel: 60 * 1000,
                max_bytes: 1 << 20,
            });
        assert!(t.render_bounded(&many, true).is_ok());
    }
}
