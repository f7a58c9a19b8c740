"""Golden logits for the CPU backend, from HF transformers loading the same GGUF.

Reference: HF transformers (GGUF loader; gguf-py dequantizes Q4_1/Q8_0 to float32) running
LlamaForCausalLM in float32 eager mode on CPU. Nobody in this project wrote it.

Usage (venv with torch, transformers, gguf, numpy):
    python make_golden_hf.py /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
Writes, next to this script:
    smollm2_q4_1_hf.json         prompt, token ids, top-20 (id, logit) per position, versions
    smollm2_q4_1_hf_last.f32     the full logits row of the last position, little-endian f32
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is"

def main():
    path = sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    d, f = os.path.split(os.path.abspath(path))
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    top = []
    for row in logits:
        order = np.argsort(-row, kind="stable")[:20]
        top.append([[int(i), float(row[i])] for i in order])
    out = {
        "reference": "HF transformers %s, torch %s, float32 eager, GGUF dequantized by gguf-py" % (
            transformers.__version__, torch.__version__),
        "model_sha256": sha,
        "prompt": PROMPT,
        "tokens": [int(i) for i in ids],
        "top20": top,
        "last_row_file": "smollm2_q4_1_hf_last.f32",
    }
    with open(os.path.join(here, "smollm2_q4_1_hf.json"), "w") as fh:
        json.dump(out, fh, indent=None)
    logits[-1].astype("<f4").tofile(os.path.join(here, "smollm2_q4_1_hf_last.f32"))
    print("tokens", len(ids), ids)
    print("argmax per position", [int(np.argmax(r)) for r in logits])

if __name__ == "__main__":
    main()
