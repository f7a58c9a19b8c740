//! The chat templates the project writes for families whose real checkpoints cannot be
//! downloaded here (`targets/chat/*.jinja`, put in synth-model's checkpoints of those families),
//! rendered by the runtime's template engine against the conversation each family's format gives,
//! written out by hand: system turn with the offered tools, a user question, the assistant's tool
//! call, the tool's answer, a follow-up; thoughts of earlier turns dropped; `enable_thinking`.

use metrale_model::{ChatMessage, ChatTemplate};
use serde_json::json;

fn template(format: &str) -> ChatTemplate {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../targets/chat/{format}.jinja"));
    ChatTemplate::new(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn qwen3() -> ChatTemplate {
    template("qwen3")
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

const TOOLS_HEAD: &str =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";
const TOOLS_TAIL: &str =
    "\n</tools>\n\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

#[test]
fn qwen3_plain_turns_and_thinking_switch() {
    let t = qwen3();
    let m = [msg("system", "Be brief."), msg("user", "Hi")];
    let on = t.render(&m, true).unwrap();
    assert_eq!(
        on,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let off = json!({"enable_thinking": false});
    let off = t
        .render_with_kwargs(&m, None, off.as_object(), true)
        .unwrap();
    assert_eq!(off, format!("{on}<think>\n\n</think>\n\n"));
    // no system turn; an earlier answer's thought dropped, the last one's kept
    let m = [
        msg("user", "a"),
        msg("assistant", "<think>\nx\n</think>\n\nA"),
        msg("user", "b"),
        msg("assistant", "<think>\ny\n</think>\n\nB"),
    ];
    assert_eq!(
        t.render(&m, false).unwrap(),
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nb<|im_end|>\n\
<|im_start|>assistant\n<think>\ny\n</think>\n\nB<|im_end|>\n"
    );
}

fn weather_tool() -> serde_json::Value {
    json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
}

fn weather_call(id: &str, city: &str) -> serde_json::Value {
    json!({"id": id, "type": "function",
           "function": {"name": "get_weather", "arguments": format!("{{\"city\": \"{city}\"}}")}})
}

/// A system turn, a question, two parallel calls and their two answers.
fn two_calls_and_answers() -> Vec<ChatMessage> {
    let mut asst = msg("assistant", "");
    asst.tool_calls = Some(json!([
        weather_call("c1", "Paris"),
        weather_call("c2", "Lyon")
    ]));
    let mut r1 = msg("tool", "{\"temp\": 21}");
    r1.tool_call_id = Some("c1".into());
    let mut r2 = msg("tool", "{\"temp\": 19}");
    r2.tool_call_id = Some("c2".into());
    vec![
        msg("system", "Be brief."),
        msg("user", "Weather in Paris and Lyon?"),
        asst,
        r1,
        r2,
    ]
}

/// Those turns after the system turn, as both Qwen formats write them.
const CALLS_AND_ANSWERS: &str = "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n\
<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call><|im_end|>\n\
<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n{\"temp\": 19}\n</tool_response><|im_end|>\n\
<|im_start|>assistant\n";

#[test]
fn qwen3_tools_calls_and_answers() {
    let t = qwen3();
    let tool = weather_tool();
    let tools = json!([tool]);
    let call = weather_call;
    let m = two_calls_and_answers();
    let got = t.render_with_tools(&m, Some(&tools), true).unwrap();
    let want = format!(
        "<|im_start|>system\nBe brief.\n\n{TOOLS_HEAD}{}{TOOLS_TAIL}{CALLS_AND_ANSWERS}",
        serde_json::to_string(&tool).unwrap()
    );
    assert_eq!(got, want);
    // tools without a system message; an answer with text before its call
    let mut asst = msg("assistant", "Checking.");
    asst.tool_calls = Some(json!([call("c1", "Paris")]));
    let got = t
        .render_with_tools(&[msg("user", "Paris?"), asst], Some(&tools), false)
        .unwrap();
    assert!(
        got.starts_with(&format!("<|im_start|>system\n{TOOLS_HEAD}")),
        "{got}"
    );
    assert!(
        got.ends_with("<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"),
        "{got}"
    );
}

#[test]
fn qwen2_default_system_turn_tools_and_answers() {
    let t = template("qwen2");
    const QWEN: &str = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
    // no system message: the format's own; a given one replaces it
    assert_eq!(
        t.render(&[msg("user", "Hi")], true).unwrap(),
        format!("<|im_start|>system\n{QWEN}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    );
    let m = [
        msg("system", "Be brief."),
        msg("user", "a"),
        msg("assistant", "A"),
    ];
    assert_eq!(
        t.render(&m, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    );
    // tools after the system text (the default one where none is given), calls and answers as Qwen3's
    let tool = weather_tool();
    let tools = json!([tool]);
    let got = t
        .render_with_tools(&two_calls_and_answers(), Some(&tools), true)
        .unwrap();
    let tool = serde_json::to_string(&tool).unwrap();
    assert_eq!(
        got,
        format!(
            "<|im_start|>system\nBe brief.\n\n{TOOLS_HEAD}{tool}{TOOLS_TAIL}{CALLS_AND_ANSWERS}"
        )
    );
    let got = t
        .render_with_tools(&[msg("user", "Paris?")], Some(&tools), true)
        .unwrap();
    assert!(
        got.starts_with(&format!(
            "<|im_start|>system\n{QWEN}\n\n{TOOLS_HEAD}{tool}{TOOLS_TAIL}"
        )),
        "{got}"
    );
}

#[test]
fn gemma3_turns_and_system_text() {
    let t = template("gemma3");
    let m = [
        msg("system", "Be brief."),
        msg("user", "Hi"),
        msg("assistant", "Hello."),
        msg("user", "Bye"),
    ];
    assert_eq!(
        t.render(&m, true).unwrap(),
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        t.render(&[msg("user", "Hi")], false).unwrap(),
        "<start_of_turn>user\nHi<end_of_turn>\n"
    );
}
