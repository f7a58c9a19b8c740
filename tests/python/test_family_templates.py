"""Each family's chat format over HTTP, with the official openai client: the default model served
with Qwen3's (`targets/chat/qwen3.jinja`, what synth-model puts in the qwen3 families'
checkpoints) and with Qwen2.5's (`targets/chat/qwen2.jinja`, the qwen2 family's) through
`--chat-template`. The model was not trained on it, so what it writes is forced
by structured output where the test needs a shape: a thought split into `reasoning_content`
(`--reasoning-format auto` resolves to deepseek for a template that writes `<think>`),
`enable_thinking: false` through `chat_template_kwargs` closing an empty thought in the prompt, a
tool call in the hermes `<tool_call>` syntax and its answer rendered as a `<tool_response>` turn,
a JSON schema. The template's text itself is checked by runtime/model/tests/chat_families.rs.

Needs METRALE_MODEL and METRALE_SERVER_BIN (conftest.py).
"""

import json
import pathlib
import re

import jsonschema
import pytest

from conftest import start_server, stop_server

REPO = pathlib.Path(__file__).resolve().parents[2]
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT = r"[a-z]{2,8}( [a-z]{2,8}){1,4}"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}


def served_with(tmp_path_factory, chat_format):
    d = tmp_path_factory.mktemp(f"{chat_format}-template")
    s = start_server(d / "log", ["--ctx-size", "1024", "--parallel", "2", "--chat-template",
                                 str(REPO / f"targets/chat/{chat_format}.jinja")])
    try:
        yield s.openai(api_key="x", timeout=120)
    finally:
        stop_server(s.proc)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    yield from served_with(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    yield from served_with(tmp_path_factory, "qwen2")


def ask(c, regex, messages=ASK, **kw):
    return c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=40,
                                     extra_body={"guided_regex": regex, **kw})


def test_thinking_on_and_off(qwen3):
    # thinking on (the default): the model opens the thought itself; it comes back apart
    r = ask(qwen3, "<think>" + THOUGHT + "</think>\n\n(Paris|Lyon)")
    m = r.choices[0].message
    assert re.fullmatch(THOUGHT, m.reasoning_content.strip()), m.reasoning_content
    assert m.content in ("Paris", "Lyon"), m.content
    # off: the prompt closes an empty thought, the answer is all content
    off = ask(qwen3, "(Paris|Lyon)", chat_template_kwargs={"enable_thinking": False})
    assert off.choices[0].message.content in ("Paris", "Lyon")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.prompt_tokens > r.usage.prompt_tokens, "the empty thought is in the prompt"


def test_tool_call_and_its_answer(qwen3):
    tool_round_trip(qwen3)


def test_qwen2_tool_call_and_its_answer(qwen2):
    tool_round_trip(qwen2)


def tool_round_trip(client):
    """A required call, its arguments valid, then its answer as a tool turn and a plain reply."""
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    no_thought = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="m", messages=q, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=80, extra_body=no_thought)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    plain = ask(client, "(Paris|Lyon)", messages=q, **no_thought)
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    turn2 = q + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r2 = client.chat.completions.create(model="m", messages=turn2, tools=[WEATHER],
                                        tool_choice="none", temperature=0, max_tokens=20,
                                        extra_body=no_thought)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    # the call and its <tool_response> turn are in the prompt (tool_choice none: no tools offered)
    assert r2.usage.prompt_tokens > plain.usage.prompt_tokens + 20, (plain.usage, r2.usage)


def test_json_schema(qwen3):
    json_schema(qwen3)


def test_qwen2_json_schema(qwen2):
    json_schema(qwen2)


def json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"enum": ["France", "Spain"]}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
