"""Reasoning output (`--reasoning-format`) with the official openai client against the real binary:
a thinking model's `<think>...</think>` comes back as `reasoning_content`, apart from `content`, in
the message and as stream deltas before the content's (vLLM's and llama-server's fields);
`chat_template_kwargs` reach the template (Qwen3's `enable_thinking`); `none` (what `auto` resolves
to for a template that never writes `<think>`, the default model's) leaves the text as written.
The default model does not think, so its output is forced with a regex (structured output): a
thought, then an answer.
"""

import re

import httpx
import pytest

from conftest import start_server, stop_server

THOUGHT = r"[a-z]{2,8}( [a-z]{2,8}){1,4}"
FORCED = "<think>" + THOUGHT + "</think>\n\n(Paris|Lyon)"
ASK = [{"role": "user", "content": "What is the capital of France?"}]

# A template that opens the thought in the prompt unless `enable_thinking` is false (then it writes
# an empty one), as Qwen3's and DeepSeek-R1's do.
OPENING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def serve(tmp_path, *args):
    return start_server(tmp_path / "server.log", ["--ctx-size", "512", "--parallel", "2", *args])


def client_of(s):
    return s.openai(api_key="x", timeout=120)


def ask(c, regex, stream=False, **kw):
    return c.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=40, stream=stream,
                                     extra_body={"guided_regex": regex, **kw})


def streamed(c, regex, **kw):
    """(thought, content, the order of the deltas' kinds) of a streamed answer."""
    thought, content, kinds = "", "", []
    for ch in ask(c, regex, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        r = getattr(d, "reasoning_content", None)
        if r:
            thought += r
            kinds.append("r")
        if d.content:
            content += d.content
            kinds.append("c")
    return thought, content, kinds


def thought_tokens(r):
    """The tokens of a completion up to the one that completes `</think>` (from its logprobs)."""
    text = ""
    for n, t in enumerate(r.choices[0].logprobs.content, 1):
        text += t.token
        if "</think>" in text:
            return n
    raise AssertionError(f"no </think> in {text!r}")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("deepseek"), "--reasoning-format", "deepseek")
    try:
        yield client_of(s)
    finally:
        stop_server(s.proc)


def test_the_thought_comes_apart_from_the_answer(deepseek):
    m = ask(deepseek, FORCED).choices[0].message
    assert m.content in ("Paris", "Lyon")
    assert re.fullmatch(THOUGHT, m.reasoning_content), m
    thought, content, kinds = streamed(deepseek, FORCED)
    assert (thought, content) == (m.reasoning_content, m.content)
    assert kinds == sorted(kinds, key=lambda k: k != "r"), "every thought delta before the content"
    assert all("think>" not in piece for piece in (thought, content))


def test_usage_counts_the_thought(deepseek):
    # completion_tokens_details.reasoning_tokens: the tokens from the one that opens the thought to
    # the one that closes it (the token texts, from logprobs, say which those are)
    r = ask(deepseek, FORCED, logprobs=True)
    want = thought_tokens(r)
    assert 0 < want < r.usage.completion_tokens, r
    assert r.usage.completion_tokens_details.reasoning_tokens == want, r.usage
    chunks = list(ask(deepseek, FORCED, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == want, chunks[-1].usage
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_none_leaves_the_text_as_written(client):
    # the session's server: --reasoning-format auto on a template without <think>
    r = ask(client, FORCED)
    m = r.choices[0].message
    assert re.fullmatch(FORCED, m.content) and getattr(m, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0, "no thought split, none counted"


def test_a_template_that_opens_the_thought_and_chat_template_kwargs(tmp_path):
    tpl = tmp_path / "opening.jinja"
    tpl.write_text(OPENING)
    s = serve(tmp_path, "--chat-template", str(tpl))  # auto: the template writes <think>
    try:
        c = client_of(s)
        # the prompt ends inside the thought: the model writes the rest of it, then </think>
        r = ask(c, THOUGHT + "</think>\n\n(Paris|Lyon)", logprobs=True)
        m = r.choices[0].message
        assert re.fullmatch(THOUGHT, m.reasoning_content) and m.content in ("Paris", "Lyon")
        assert r.usage.completion_tokens_details.reasoning_tokens == thought_tokens(r), r.usage
        # enable_thinking false: the template closes an empty thought; the answer is all content
        off = ask(c, "(Paris|Lyon)", chat_template_kwargs={"enable_thinking": False})
        assert off.choices[0].message.content in ("Paris", "Lyon")
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert off.usage.prompt_tokens > r.usage.prompt_tokens, "the kwargs changed the prompt"
        bad = httpx.post(s.base + "/v1/chat/completions",
                         json={"messages": ASK, "chat_template_kwargs": [1]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text
    finally:
        stop_server(s.proc)


def test_a_bad_reasoning_format_stops_the_start(tmp_path):
    with pytest.raises(pytest.fail.Exception):
        s = serve(tmp_path, "--reasoning-format", "r1")
        stop_server(s.proc)
    assert "possible values: none, deepseek, harmony, auto" in open(tmp_path / "server.log").read()


def test_responses_carry_the_thought_as_a_reasoning_item(deepseek):
    # /v1/responses: the thought is a reasoning item before the message, whole and streamed
    ask_r = dict(model="m", input=ASK[0]["content"], temperature=0, max_output_tokens=40,
                 extra_body={"guided_regex": FORCED})
    r = deepseek.responses.create(**ask_r)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    thought = r.output[0].content[0].text
    assert re.fullmatch(THOUGHT, thought) and r.output_text in ("Paris", "Lyon"), r
    events = list(deepseek.responses.create(**ask_r, stream=True))
    types = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    last_thought = max(i for i, t in enumerate(types) if t == "response.reasoning_text.delta")
    assert types.index("response.output_text.delta") > types.index("response.output_item.done") > last_thought
    done = events[-1].response
    assert types[-1] == "response.completed" and [o.type for o in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == thought and done.output_text == r.output_text
    # the thought's tokens counted apart, streamed and whole alike
    n = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < n < r.usage.output_tokens and done.usage.output_tokens_details.reasoning_tokens == n, r.usage
