#!/usr/bin/env python3
"""Golden chat prompts: the default GGUF's own chat template rendered by Python jinja2 the way HF
transformers' apply_chat_template does (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, raise_exception), with bos_token/eos_token set to the GGUF's BOS/EOS token texts.

Reference: jinja2 (version recorded) over tokenizer.chat_template read with the `gguf` package.
Usage: make_chat_golden.py MODEL_GGUF   (or set METRALE_MODEL; venv: pip install jinja2 gguf)
MODEL_GGUF is SmolLM2-135M-Instruct.Q4_1.gguf (`cargo xtask fetch-model smollm2-135m` fetches it).
Writes chat_template_jinja2.json next to this script; tests/tokenizer_golden.rs compares
ChatTemplate::render with it.
"""
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("METRALE_MODEL")
if not MODEL:  # before the third-party imports, so the usage line shows without them
    sys.exit("usage: make_chat_golden.py MODEL_GGUF (or set METRALE_MODEL): the path of "
             "SmolLM2-135M-Instruct.Q4_1.gguf")

import gguf  # noqa: E402
import jinja2  # noqa: E402
import jinja2.ext  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."
CONVERSATIONS = [
    ([{"role": "user", "content": QUESTION}], True),
    ([{"role": "user", "content": QUESTION}], False),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}], True),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "  and 3+3?\n"}], True),
    ([{"role": "user", "content": "Unicode: 日本語 🦀 café"}], True),
]


def field_str(reader, key):
    f = reader.fields[key]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def field_int(reader, key):
    f = reader.fields[key]
    return int(f.parts[f.data[0]][0])


def main():
    r = gguf.GGUFReader(MODEL)
    src = field_str(r, "tokenizer.chat_template")
    tokens_field = r.fields["tokenizer.ggml.tokens"]
    tok = lambda i: bytes(tokens_field.parts[tokens_field.data[i]]).decode("utf-8")
    bos, eos = tok(field_int(r, "tokenizer.ggml.bos_token_id")), tok(field_int(r, "tokenizer.ggml.eos_token_id"))

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    t = env.from_string(src)
    cases = [{"messages": m, "add_generation_prompt": g,
              "prompt": t.render(messages=m, add_generation_prompt=g, bos_token=bos, eos_token=eos)}
             for m, g in CONVERSATIONS]
    doc = {
        "reference": f"python jinja2 {jinja2.__version__}, HF apply_chat_template settings "
                     "(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols)",
        "model": os.path.basename(MODEL),
        "model_sha256": hashlib.sha256(open(MODEL, "rb").read()).hexdigest(),
        "template": src,
        "bos_token": bos,
        "eos_token": eos,
        "made_by": "runtime/model/tests/golden/make_chat_golden.py",
        "cases": cases,
    }
    with open(os.path.join(HERE, "chat_template_jinja2.json"), "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    print(cases[0]["prompt"])


if __name__ == "__main__":
    main()
