"""gpt-oss's harmony output over HTTP, with the official openai client: a synthetic gpt-oss
checkpoint (`cargo xtask synth-model tests/golden/tiny-gpt-oss.toml`: its vocabulary carries
harmony's special tokens) served with `--reasoning-format harmony`. The random model writes no
harmony of its own, so structured output (a Lark grammar with the special tokens) forces the
messages a gpt-oss model writes: its analysis channel must come back as `reasoning_content`, a
message to `functions.get_weather` as a tool call (finish reason `tool_calls`, the generation
ended by `<|call|>`), the final channel as `content` (ended by `<|return|>`), streamed or not; no
header text (channel names, recipients, `json`) may reach the client.

Needs METRALE_MODEL (the synthetic model's tokenizer) and METRALE_GPT_OSS_SERVER_BIN: a server
binary without a target compiled in (a plain release build, which serves any family; ci/test.sh
keeps one before the tests' target builds replace target/release/metrale-server).
"""

import json
import os
import pathlib
import subprocess

import pytest

from conftest import start_server, stop_server

REPO = pathlib.Path(__file__).resolve().parents[2]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = ('start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> <|start|> "assistant" '
        '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
        '"{\\"city\\": \\"Paris\\"}" <|call|>')
ANSWER = ('start: <|channel|> "analysis" <|message|> "It is sunny." <|end|> <|start|> "assistant" '
          '<|channel|> "final" <|message|> "Sunny, 21 C." <|return|> "ignored"')


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    tok = os.environ.get("METRALE_MODEL")
    if not tok:
        pytest.skip("METRALE_MODEL (the default model: the synthetic model's tokenizer) is needed")
    d = tmp_path_factory.mktemp("harmony")
    p = subprocess.run([str(REPO / "target/release/xtask"), "synth-model",
                        str(REPO / "tests/golden/tiny-gpt-oss.toml"), "--tokenizer", tok,
                        "--out", str(d / "gpt-oss.gguf")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    # a binary that serves this test-size gpt-oss (METRALE_SERVER_BIN serves SmolLM2 only): a
    # plain `cargo build --release -p metrale-server` (ci/test.sh keeps one)
    binary = os.environ.get("METRALE_GPT_OSS_SERVER_BIN")
    if not binary:
        pytest.skip("METRALE_GPT_OSS_SERVER_BIN is not set (a plain release build of metrale-server)")
    s = start_server(d / "log", ["--ctx-size", "1024", "--parallel", "2",
                                 "--reasoning-format", "harmony"], model=str(d / "gpt-oss.gguf"),
                     binary=binary)
    try:
        yield s.openai(api_key="x", timeout=120)
    finally:
        stop_server(s.proc)


def test_a_tool_call_with_its_thought(gpt_oss):
    r = gpt_oss.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], temperature=0,
                                        max_tokens=200, extra_body={"guided_grammar": CALL})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.reasoning_content == "Need the weather."
    assert not c.message.content
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0].function
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens


def test_a_streamed_answer_with_its_thought(gpt_oss):
    thought, content, finish = "", "", None
    for ch in gpt_oss.chat.completions.create(model="m", messages=ASK, temperature=0,
                                              max_tokens=200, stream=True,
                                              extra_body={"guided_grammar": ANSWER}):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        thought += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        finish = ch.choices[0].finish_reason or finish
    assert (thought, content, finish) == ("It is sunny.", "Sunny, 21 C.", "stop")


def test_a_forced_tool_choice_is_a_harmony_call(gpt_oss):
    # required: the grammar writes the call as harmony's message (the city at most 12 letters, so
    # the random model's string ends); its arguments the tool's schema
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["parameters"]["properties"]["city"]["maxLength"] = 12
    r = gpt_oss.chat.completions.create(model="m", messages=ASK, tools=[tool], max_tokens=60,
                                        temperature=0, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
