"""The Responses API (`POST /v1/responses`) with the official openai client against the real binary
and the real model: answers are the chat endpoint's for the same conversation (greedy, so the same
text); the typed stream events come in order and add up to the whole response, through the client's
own streaming helper too; `max_output_tokens` makes an incomplete response; `text.format` constrains
the output (the client's `responses.parse` reads it back into a pydantic model); function tools
round-trip through `function_call` and `function_call_output` items, whole and streamed; what the
server cannot serve (stored responses, other tool types, non-text input) is a 400 naming the field.
"""

import json

import jsonschema
import openai
import pytest

Q = "What is the capital of France? Answer in one sentence."

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"]}}


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens)
    return r


def test_an_answer_is_the_chat_endpoints_for_the_same_conversation(client):
    r = client.responses.create(model="m", input=Q, temperature=0, max_output_tokens=40)
    c = chat_text(client, [{"role": "user", "content": Q}], 40)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == c.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == 40 and r.temperature == 0 and r.incomplete_details is None
    # instructions are the system message; input items are messages
    r2 = client.responses.create(model="m", instructions="You answer in French.", temperature=0,
                                 max_output_tokens=30,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": Q}]}])
    c2 = chat_text(client, [{"role": "system", "content": "You answer in French."},
                            {"role": "user", "content": Q}], 30)
    assert r2.output_text == c2.choices[0].message.content
    assert r2.instructions == "You answer in French."


def test_stream_events_come_in_order_and_add_up_to_the_response(client):
    whole = client.responses.create(model="m", input=Q, temperature=0, max_output_tokens=40)
    events = list(client.responses.create(model="m", input=Q, temperature=0, max_output_tokens=40,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3, "the text streams as it is made"
    text = "".join(deltas)
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the client's streaming helper accumulates the same
    with client.responses.stream(model="m", input=Q, temperature=0, max_output_tokens=40) as s:
        helper_deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        got = s.get_final_response()
    assert helper_deltas == text and got.output_text == text


def test_max_output_tokens_cuts_an_incomplete_response(client):
    r = client.responses.create(model="m", input=Q, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text
    last = list(client.responses.create(model="m", input=Q, temperature=0, max_output_tokens=3,
                                        stream=True))[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == r.output_text


def test_text_format_constrains_the_output(client):
    from pydantic import BaseModel

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model="m", input=Q, temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"

    class Place(BaseModel):
        city: str
        country: str

    p = client.responses.parse(model="m", input=Q, temperature=0, max_output_tokens=60, text_format=Place)
    assert isinstance(p.output_parsed, Place) and p.output_parsed.city


def test_function_tools_round_trip_whole_and_streamed(client):
    q = "What is the weather in Paris?"
    r = client.responses.create(model="m", input=q, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # the call and its output go back as items; the model answers in text
    r2 = client.responses.create(model="m", tools=[WEATHER], tool_choice="none", temperature=0,
                                 max_output_tokens=30, input=[
                                     {"role": "user", "content": q},
                                     {"type": "function_call", "call_id": calls[0].call_id,
                                      "name": calls[0].name, "arguments": calls[0].arguments},
                                     {"type": "function_call_output", "call_id": calls[0].call_id,
                                      "output": "18 degrees and sunny"}])
    assert r2.output_text and not [o for o in r2.output if o.type == "function_call"]
    # streamed: the call is an item whose arguments come as deltas
    events = list(client.responses.create(model="m", input=q, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=80,
                                          stream=True))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == args == calls[0].arguments
    assert events[-1].type == "response.completed"
    assert [o.arguments for o in events[-1].response.output if o.type == "function_call"] == [args]


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}}, "text.format"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(client, extra, param):
    args = {"model": "m", "input": Q, "max_output_tokens": 8, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**args)
    assert e.value.body["param"] == param, e.value.body


def test_the_raw_stream_names_each_event_and_ends_without_done(http):
    with http.stream("POST", "/v1/responses", json={"model": "m", "input": Q, "temperature": 0,
                                                     "max_output_tokens": 12, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    frames = [f for f in body.split("\n\n") if f.strip() and not f.startswith(":")]
    for f in frames:
        event, data = f.split("\n", 1)
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in body
    # a malformed body is a 400 in the OpenAI envelope
    bad = http.post("/v1/responses", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
