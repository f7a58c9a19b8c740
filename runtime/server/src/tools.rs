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
//! With tools offered and a choice other than `none`, a choice's text is held until it finishes,
//! then sent as `tool_calls` (finish reason `tool_calls`) when it parses as calls, else as text.

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
        let params = |t: &ToolIn| {
            let mut p = t
                .function
                .parameters
                .clone()
                .unwrap_or(json!({"type": "object"}));
            if let Some(o) = p.as_object_mut() {
                o.entry("additionalProperties").or_insert(json!(false));
            }
            p
        };
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

    /// A grammar that forces calls (`required`: any of the tools; named: that one), else `None`.
    pub fn grammar(&self) -> Option<TopLevelGrammar> {
        let names: Vec<&ToolIn> = match &self.choice {
            Choice::Auto => return None,
            Choice::Required => self.list.iter().collect(),
            Choice::Named(n) => self.list.iter().filter(|t| &t.function.name == n).collect(),
        };
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

    /// The calls `text` makes, or `None` when it is not (only) tool calls.
    pub fn parse(&self, text: &str) -> Option<Vec<Call>> {
        let known = |n: &str| self.list.iter().any(|t| t.function.name == n);
        let call = |v: &Value, args: &str| -> Option<Call> {
            let name = v.get("name")?.as_str()?;
            let a = v
                .get(args)
                .or_else(|| v.get("arguments"))
                .or_else(|| v.get("parameters"))?;
            known(name).then(|| Call {
                name: name.to_string(),
                arguments: a.to_string(),
            })
        };
        let calls: Vec<Call> = match self.format {
            ToolFormat::Hermes => {
                let mut rest = text.trim();
                let mut out = Vec::new();
                while !rest.is_empty() {
                    let body = rest.strip_prefix("<tool_call>")?;
                    let end = body.find("</tool_call>")?;
                    let v: Value = serde_json::from_str(body[..end].trim()).ok()?;
                    out.push(call(&v, "arguments")?);
                    rest = body[end + "</tool_call>".len()..].trim_start();
                }
                out
            }
            ToolFormat::Llama3Json => {
                let t = text.trim();
                if !t.starts_with('{') {
                    return None;
                }
                let mut out = Vec::new();
                let mut rest = t;
                loop {
                    let mut de = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                    let v = de.next()?.ok()?;
                    out.push(call(&v, "parameters")?);
                    rest = rest[de.byte_offset()..].trim_start();
                    if rest.is_empty() {
                        break;
                    }
                    rest = rest.strip_prefix(';')?.trim_start();
                }
                out
            }
        };
        (!calls.is_empty()).then_some(calls)
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

    #[test]
    fn both_formats_parse_what_they_render() {
        for f in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
            let t = tools(f);
            let calls = vec![
                ("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string()),
                ("add".to_string(), r#"{"a":1,"b":2}"#.to_string()),
            ];
            let text = f.render(&calls);
            let got = t.parse(&text).unwrap_or_else(|| panic!("{f:?}: {text}"));
            assert_eq!(got.len(), 2, "{text}");
            assert_eq!(got[0].name, "get_weather");
            assert_eq!(
                serde_json::from_str::<Value>(&got[0].arguments).unwrap(),
                json!({"city": "Paris"})
            );
            assert_eq!(got[1].name, "add");
            // text that is not calls
            assert!(t.parse("The weather is fine.").is_none());
            assert!(t
                .parse(&text.replace("get_weather", "unknown_fn"))
                .is_none());
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
}
