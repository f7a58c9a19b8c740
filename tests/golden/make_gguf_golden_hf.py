"""Golden logits of a synthetic GGUF in llama.cpp's Q4_K_M mix, from HF transformers loading that file.

The file is tests/golden/tiny-llama3.toml (see make_synth_golden_hf.py) with seed 0 in the Q4_K_M mix
(Q4_K matrices, Q6_K for the LM head and for attn_v / ffn_down on the layers llama.cpp gives more
bits), and the HF folder of the same seed for its config and tokenizer:
    cargo xtask synth-model tests/golden/tiny-llama3.toml --quant q4_k_m --out FILE.gguf
    cargo xtask synth-model tests/golden/tiny-llama3.toml --format hf --out DIR
    python make_gguf_golden_hf.py DIR FILE.gguf
Reference: transformers' GGUF reader (gguf-py dequantises the Q4_K and Q6_K blocks to f32; nobody in
this project wrote either) into LlamaForCausalLM, float32, eager attention, on CPU, with the folder's
config (its llama3 RoPE scaling: the GGUF reader drops `rope_freqs`, whose divisors are that
scaling). The sequence and checked positions are make_synth_golden_hf.py's.

Usage (venv with torch, transformers, gguf, numpy):
    python make_gguf_golden_hf.py DIR FILE.gguf [--out PREFIX]
Writes PREFIX.json (default tests/golden/tiny_llama3_q4km_hf.json: the GGUF's sha256, prompt and
token ids, top-20 (id, logit) per checked position, versions) and PREFIX_last.f32 (the last
position's full logits row, little-endian f32).
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_synth_golden_hf import CONTINUATION, DECODE_STEPS, PROMPT, top20  # noqa: E402


def main():
    argv = sys.argv[1:]
    here = os.path.dirname(os.path.abspath(__file__))
    prefix = os.path.join(here, "tiny_llama3_q4km_hf")
    if "--out" in argv:
        i = argv.index("--out")
        prefix = argv[i + 1]
        del argv[i:i + 2]
    d, g = os.path.abspath(argv[0]), os.path.abspath(argv[1])
    sha = hashlib.sha256(open(g, "rb").read()).hexdigest()
    tok = AutoTokenizer.from_pretrained(d)
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    cont = tok(CONTINUATION, add_special_tokens=False)["input_ids"][:DECODE_STEPS]
    ids = prompt + cont
    cfg = AutoConfig.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(g), gguf_file=os.path.basename(g),
                                                 config=cfg, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    checked = logits[len(prompt) - 1: len(prompt) - 1 + DECODE_STEPS + 1]
    top = top20(checked)
    # the bf16 folder of the same seed: how far 4-6-bit weights move the logits (recorded)
    bf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        bl = bf(torch.tensor([ids])).logits[0].float().numpy()[len(prompt) - 1:]
    rel = float(np.linalg.norm(bl - logits[len(prompt) - 1:]) / np.linalg.norm(bl))
    out = {
        "reference": "HF transformers %s, torch %s, gguf-py %s, float32 eager on cpu, the GGUF through "
                     "transformers' GGUF reader with the HF folder's config" % (
                         transformers.__version__, torch.__version__, _gguf_version()),
        "gguf_sha256": sha,
        "prompt": PROMPT,
        "continuation": CONTINUATION,
        "prompt_tokens": [int(i) for i in prompt],
        "decode_tokens": [int(i) for i in cont],
        "top20": top,
        "logit_std": float(checked.std()),
        "vs_bf16_folder_relative_l2": rel,
        "last_row_file": os.path.basename(prefix) + "_last.f32",
    }
    with open(prefix + ".json", "w") as fh:
        json.dump(out, fh, indent=None)
    checked[-1].astype("<f4").tofile(prefix + "_last.f32")
    print("prompt tokens", len(prompt), "decode tokens", len(cont), "logit std", checked.std())
    print("argmax", [int(np.argmax(r)) for r in checked])
    print("against the bf16 folder: relative L2", rel)


def _gguf_version():
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    main()
