"""Structured output (grammar-constrained decoding, llguidance) with the official openai client, on a
random-weight model made by `cargo xtask synth-model` (SmolLM2-135M's shape, 2 layers, so the cpu
target binary serves it; it knows no JSON, so the grammar does all the work): a non-trivial schema (nested objects, enums, arrays with
bounds, required keys) holds in 100 of 100 seeded samples at temperature 1, streamed and whole;
json_object, regex and choice constraints; a schema the engine cannot compile is a 400 naming it.

Needs METRALE_MODEL (the default model: the tokenizer of the synthetic one).
"""

import json
import os
import pathlib
import subprocess
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from conftest import start_server, stop_server

REPO = pathlib.Path(__file__).resolve().parents[2]

# nested objects, enums, a bounded array, required keys (runtime/server/examples/mask_bench.rs reads it too)
SCHEMA = json.loads((REPO / "tests/python/water-schema.json").read_text())


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    tok = os.environ.get("METRALE_MODEL")
    if not tok:
        pytest.skip("METRALE_MODEL (the default model: the synthetic model's tokenizer) is needed")
    d = tmp_path_factory.mktemp("structured")
    gguf = d / "tiny.gguf"
    p = subprocess.run([str(REPO / "target/release/xtask"), "synth-model", "smollm2-135m", "--layers", "2",
                        "--tokenizer", tok, "--seed", "3", "--out", str(gguf)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    s = start_server(d / "log", ["--ctx-size", "512", "--parallel", "8"], model=str(gguf))
    try:
        yield s.openai(api_key="none")
    finally:
        stop_server(s.proc)


def ask(client, seed, stream=False, **kw):
    args = dict(model="m", messages=[{"role": "user", "content": "Describe a body of water."}],
                temperature=1.0, seed=seed, max_tokens=200, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def test_a_nested_schema_holds_in_100_of_100_seeded_samples(synth):
    rf = {"type": "json_schema", "json_schema": {"name": "water", "schema": SCHEMA, "strict": True}}

    def one(seed):
        return ask(synth, seed, stream=seed % 2 == 1, response_format=rf)

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(100)))
    bad = []
    for seed, (text, finish) in enumerate(results):
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            assert finish == "stop", finish
        except Exception as e:  # collect them all, then fail with the first few
            bad.append((seed, finish, text[:200], str(e)[:200]))
    assert not bad, f"{len(bad)} of 100 samples broke the schema: {bad[:3]}"
    # the same seed, the same output
    assert ask(synth, 7, response_format=rf) == results[7]


def test_masks_are_counted_in_metrics(synth):
    import urllib.request
    base = str(synth.base_url).rstrip("/").removesuffix("/v1")

    def counters():
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        got = {}
        for line in text.splitlines():
            if line.startswith("metrale:grammar_mask"):
                got[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        return got

    before = counters()
    r = synth.chat.completions.create(model="m", messages=[{"role": "user", "content": "Water?"}],
                                      seed=5, max_tokens=40, response_format={"type": "json_object"})
    after = counters()
    n = after["metrale:grammar_masks_total"] - before["metrale:grammar_masks_total"]
    # one mask per constrained token (the prompt's last chunk samples the first)
    assert n >= r.usage.completion_tokens > 0, (n, r.usage)
    assert after["metrale:grammar_mask_seconds_total"] > before["metrale:grammar_mask_seconds_total"]
    # an unconstrained request asks none
    synth.chat.completions.create(model="m", messages=[{"role": "user", "content": "Water?"}],
                                  seed=5, max_tokens=8)
    assert counters()["metrale:grammar_masks_total"] == after["metrale:grammar_masks_total"]


def test_json_object_regex_and_choice(synth):
    text, _ = ask(synth, 1, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    text, _ = ask(synth, 2, extra_body={"guided_regex": r"[A-Z][a-z]{2,8} \d{3}-\d{4}"})
    import re
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{3}-\d{4}", text), text
    text, _ = ask(synth, 3, extra_body={"guided_choice": ["yes", "no", "maybe (1+1)"]})
    assert text in ("yes", "no", "maybe (1+1)"), text
    text, _ = ask(synth, 4, extra_body={"structured_outputs": {"choice": ["north", "south"]}})
    assert text in ("north", "south"), text


def test_a_schema_that_cannot_compile_is_a_400_naming_it(synth):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        ask(synth, 1, response_format={"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
    assert e.value.body["param"] == "response_format"
    assert "cannot be compiled" in e.value.body["message"] and "nowhere" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        ask(synth, 1, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert "give one structured-output constraint" in e.value.body["message"]


# ---------------------------------------------------------------- tool calling (the real model,
# SmolLM2: the hermes `<tool_call>` syntax)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}


def test_tool_calls_round_trip_through_two_turns(client):
    import openai
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=q, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # second turn: the call and its answer go back; the model answers in text
    turn2 = q + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r2 = client.chat.completions.create(model="m", messages=turn2, tools=[WEATHER, TIME], tool_choice="none",
                                        temperature=0, max_tokens=30)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    # a named choice calls that function; an unknown name is a 400
    r3 = client.chat.completions.create(model="m", messages=q, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [t.function.name for t in r3.choices[0].message.tool_calls] == ["get_time"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=q, tools=[WEATHER], max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_streamed_tool_calls_arrive_as_deltas(client):
    """The call's first delta carries its id and name, then the arguments come piece by piece as the
    model writes them (as OpenAI streams them), and they concatenate to valid arguments."""
    q = [{"role": "user", "content": "What is the time in Tokyo?"}]
    names, ids, args, pieces, finish = [], [], "", 0, None
    for chunk in client.chat.completions.create(model="m", messages=q, tools=[TIME], tool_choice="required",
                                                parallel_tool_calls=False, temperature=0, max_tokens=80,
                                                stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                if tc.function.name:
                    names.append(tc.function.name)
                    ids.append(tc.id)
                    assert tc.function.arguments == "", "the start carries no arguments"
                if tc.function.arguments:
                    pieces += 1
                    args += tc.function.arguments
            finish = ch.finish_reason or finish
    assert names == ["get_time"] and ids[0].startswith("call_") and finish == "tool_calls"
    assert pieces >= 3, f"the arguments came in {pieces} piece(s): {args!r}"
    jsonschema.validate(json.loads(args), TIME["function"]["parameters"])


def test_text_streams_as_it_comes_when_tools_are_offered(client):
    """With tool_choice auto and an answer in text, the text is not held back until the end."""
    q = [{"role": "user", "content": "Write one sentence about the sea."}]
    texts, calls, finish = [], 0, None
    for chunk in client.chat.completions.create(model="m", messages=q, tools=[TIME], tool_choice="auto",
                                                temperature=0, max_tokens=24, stream=True):
        for ch in chunk.choices:
            if ch.delta.content:
                texts.append(ch.delta.content)
            calls += len(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert calls == 0 and finish in ("stop", "length"), (texts, calls, finish)
    assert len(texts) >= 5, f"the text came in {len(texts)} piece(s): {texts}"
