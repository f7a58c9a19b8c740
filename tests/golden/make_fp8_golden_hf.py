"""Golden logits of a synthetic FP8 checkpoint (compressed-tensors layout), from HF transformers.

The checkpoint: tests/golden/tiny-llama3.toml with seed 0, layer matrices FP8 e4m3 with one f32
scale per output channel, activations quantized per token (llm-compressor's FP8_DYNAMIC scheme):
    cargo xtask synth-model tests/golden/tiny-llama3.toml --quant fp8 --format hf --out DIR
    python make_fp8_golden_hf.py DIR [BF16_DIR] --out tests/golden/tiny_llama3_fp8_hf

Reference: HF transformers' LlamaForCausalLM in float32, eager attention, on CPU. Its weights are
the folder's, dequantized by torch (`weight.to(float32) * weight_scale`, torch's float8_e4m3fn
decoding); every linear layer of the decoder (not the LM head, which the checkpoint keeps in bf16,
its config's `ignore`) quantizes its input as vLLM's FP8 W8A8 path does: per token,
scale = max|x| / 448, x' = (x / scale).clamp(-448, 448) cast to float8_e4m3fn and back, times
scale. Nobody in this project wrote that code path (torch's cast, HF's model). transformers itself
would need the compressed-tensors package to read the folder; it is read here with safetensors
and the quantization config left out, so the computation is exactly the one stated above.
It also records how far the reference moves from itself when every linear layer's input is
moved by one ulp (x * (1 + 2^-23)) before quantization: W8A8 rounding is chaotic at e4m3's ties,
so this is the spread any other implementation's f32 arithmetic may show (the test's bounds).
With BF16_DIR (the same seed in bf16) it also records how far the FP8 model's logits are from the
bf16 model's (what FP8 costs this model; recorded, not asserted).

Writes PREFIX.json (prompt, ids, top-20 per checked position, versions, the sha256 of
model.safetensors) and PREFIX_last.f32 (the last position's full logits row), as
make_synth_golden_hf.py does.
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_synth_golden_hf import CONTINUATION, DECODE_STEPS, PROMPT, top20  # noqa: E402


class Fp8Linear(torch.nn.Module):
    """y = x' W^T with x' the input quantized per token to e4m3 (vLLM's dynamic FP8)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        xq = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * scale
        return torch.nn.functional.linear(xq, self.weight)


def fp8_model(d):
    cfg = AutoConfig.from_pretrained(d)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32,
                                             attn_implementation="eager")
    sd = load_file(os.path.join(d, "model.safetensors"))
    state = {}
    for k, v in sd.items():
        if k.endswith("_scale"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            v = v.to(torch.float32) * sd[k + "_scale"].to(torch.float32)
        state[k] = v.to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m or m == "lm_head.weight" and cfg.tie_word_embeddings for m in missing), missing
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Fp8Linear(child.weight.data))
    model.eval()
    return model, cfg


def main():
    argv = sys.argv[1:]
    i = argv.index("--out")
    prefix = argv[i + 1]
    del argv[i:i + 2]
    d = os.path.abspath(argv[0])
    sha = hashlib.sha256(open(os.path.join(d, "model.safetensors"), "rb").read()).hexdigest()
    tok = AutoTokenizer.from_pretrained(d)
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    cont = tok(CONTINUATION, add_special_tokens=False)["input_ids"][:DECODE_STEPS]
    ids = prompt + cont
    model, cfg = fp8_model(d)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    checked = logits[len(prompt) - 1: len(prompt) - 1 + DECODE_STEPS + 1]
    forward = Fp8Linear.forward
    Fp8Linear.forward = lambda self, x: forward(self, x * (1 + 2.0 ** -23))
    with torch.no_grad():
        moved = model(torch.tensor([ids])).logits[0].float().numpy()
    Fp8Linear.forward = forward
    moved = moved[len(prompt) - 1: len(prompt) - 1 + DECODE_STEPS + 1]
    cfg_json = json.load(open(os.path.join(d, "config.json")))
    out = {
        "reference": "HF transformers %s, torch %s, float32 eager on cpu; FP8 weights dequantized "
                     "by torch, decoder linears' inputs quantized per token to float8_e4m3fn" % (
                         transformers.__version__, torch.__version__),
        "model": {k: cfg_json.get(k) for k in ("num_hidden_layers", "hidden_size",
                                                "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "vocab_size", "tie_word_embeddings")},
        "quantization_config": cfg_json.get("quantization_config"),
        "safetensors_sha256": sha,
        "prompt": PROMPT,
        "continuation": CONTINUATION,
        "prompt_tokens": [int(i) for i in prompt],
        "decode_tokens": [int(i) for i in cont],
        "top20": top20(checked),
        "logit_std": float(checked.std()),
        "inputs_moved_1ulp_mean_abs_diff_last_row": float(np.abs(moved[-1] - checked[-1]).mean()),
        "inputs_moved_1ulp_max_abs_diff": float(np.abs(moved - checked).max()),
        "inputs_moved_1ulp_same_argmax": int((moved.argmax(-1) == checked.argmax(-1)).sum()),
        "last_row_file": os.path.basename(prefix) + "_last.f32",
    }
    if len(argv) > 1:
        bf = AutoModelForCausalLM.from_pretrained(os.path.abspath(argv[1]), torch_dtype=torch.float32,
                                                  attn_implementation="eager")
        with torch.no_grad():
            bl = bf(torch.tensor([ids])).logits[0].float().numpy()
        bchecked = bl[len(prompt) - 1: len(prompt) - 1 + DECODE_STEPS + 1]
        out["vs_bf16_max_abs_diff"] = float(np.abs(bchecked - checked).max())
        out["vs_bf16_same_argmax"] = int((bchecked.argmax(-1) == checked.argmax(-1)).sum())
    with open(prefix + ".json", "w") as fh:
        json.dump(out, fh, indent=None)
    checked[-1].astype("<f4").tofile(prefix + "_last.f32")
    print("logit std", checked.std(), "argmax", [int(np.argmax(r)) for r in checked])
    for k in ("inputs_moved_1ulp_mean_abs_diff_last_row", "inputs_moved_1ulp_max_abs_diff",
              "inputs_moved_1ulp_same_argmax", "vs_bf16_max_abs_diff", "vs_bf16_same_argmax"):
        if k in out:
            print(k, out[k])


if __name__ == "__main__":
    main()
