"""`POST /v1/embeddings` with the official openai client against the real binary and the real model
(the session's server runs with `--embeddings`, mean pooling): each input is a unit vector of the
model's hidden size (576); a list keeps its order, and the same text gives the same vector alone,
in a list, or as its token ids; the client's default transport (base64, which it decodes) and
`encoding_format="float"` carry the same float32 values; `usage` counts the inputs' tokens; what
cannot be served (`dimensions`, an empty input, an unknown encoding, a server started without
`--embeddings`) is a 400 that says what to do. Against llama.cpp: `embeddings_golden.json`, made by
`tests/golden/make_embedding_golden.sh` with llama.cpp's `llama-embedding` on the same GGUF (mean
pooling, Euclidean normalisation); our vectors must point the same way: cosine >= 0.998 (measured
0.9994-0.9999 on these four texts, largest element difference 0.01: llama.cpp's CPU path multiplies
the Q4_1 weights with activations rounded to 8 bits, ours with 16-bit integer blocks).
"""

import json
import math
import os
import struct

import openai
import pytest

from conftest import start_server, stop_server

HIDDEN = 576
TEXTS = ["The capital of France is Paris.", "Water boils at 100 degrees Celsius at sea level.",
         "def add(a, b):\n    return a + b"]


def f32(xs):
    return [struct.unpack("<f", struct.pack("<f", x))[0] for x in xs]


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / (norm(a) * norm(b))


def test_one_input_is_a_unit_vector_of_the_hidden_size(client, http):
    r = client.embeddings.create(model="m", input=TEXTS[0])
    assert r.object == "list" and len(r.data) == 1
    d = r.data[0]
    assert d.object == "embedding" and d.index == 0 and len(d.embedding) == HIDDEN
    assert abs(norm(d.embedding) - 1.0) < 1e-4
    ids = http.post("/tokenize", json={"content": TEXTS[0], "add_special": True}).json()["tokens"]
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(ids)


def test_a_list_keeps_its_order_and_equal_inputs_give_equal_vectors(client, http):
    alone = [client.embeddings.create(model="m", input=t).data[0].embedding for t in TEXTS]
    r = client.embeddings.create(model="m", input=[TEXTS[1], TEXTS[0], TEXTS[2], TEXTS[1]])
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    got = [d.embedding for d in r.data]
    for g, w in zip(got, [alone[1], alone[0], alone[2], alone[1]]):
        assert max(abs(a - b) for a, b in zip(g, w)) < 1e-6
    # different texts point different ways
    assert cosine(alone[0], alone[1]) < 0.999
    # token ids (one list, and a list of lists) are the same inputs
    ids = [http.post("/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in TEXTS]
    one = client.embeddings.create(model="m", input=ids[0]).data[0].embedding
    assert max(abs(a - b) for a, b in zip(one, alone[0])) < 1e-6
    many = client.embeddings.create(model="m", input=ids).data
    for d, w in zip(many, alone):
        assert max(abs(a - b) for a, b in zip(d.embedding, w)) < 1e-6
    assert client.embeddings.create(model="m", input=ids).usage.prompt_tokens == sum(map(len, ids))


def test_base64_and_float_carry_the_same_values(client, http):
    # the client asks for base64 unless told otherwise and decodes it to float32 values
    b64 = client.embeddings.create(model="m", input=TEXTS[2]).data[0].embedding
    flt = client.embeddings.create(model="m", input=TEXTS[2], encoding_format="float").data[0].embedding
    assert f32(flt) == f32(b64)
    raw = http.post("/v1/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"}).json()
    s = raw["data"][0]["embedding"]
    assert isinstance(s, str)
    import base64
    vals = struct.unpack(f"<{HIDDEN}f", base64.b64decode(s))
    assert list(vals) == f32(b64)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "dimensions": 64}, "dimensions", ["576", "leave 'dimensions' out"]),
    ({"input": ""}, "input", ["empty"]),
    ({"input": []}, "input", ["empty"]),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ["float", "base64"]),
    ({"input": [[1, 2], [-5]]}, "input", ["outside the vocabulary"]),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(http, body, param, words):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and all(w in e["message"] for w in words), e


def test_an_input_longer_than_the_context_is_refused(http):
    from conftest import CTX_SIZE
    r = http.post("/v1/embeddings", json={"input": [1] * (CTX_SIZE + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_a_server_without_embeddings_says_how_to_turn_them_on(tmp_path):
    s = start_server(tmp_path / "server.log", ["--ctx-size", "256", "--parallel", "1"])
    try:
        c = s.openai(api_key="x", timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model="m", input="hi")
        assert "--embeddings" in str(e.value)
    finally:
        stop_server(s.proc)


def test_vectors_point_where_llama_cpp_points(client):
    path = os.path.join(os.path.dirname(__file__), "..", "golden", "embeddings_golden.json")
    golden = json.load(open(path))
    for item in golden["items"]:
        v = client.embeddings.create(model="m", input=item["text"], encoding_format="float").data[0].embedding
        c = cosine(v, item["embedding"])
        assert c >= 0.998, f"{item['text']!r}: cosine {c:.4f} with llama.cpp's embedding"
