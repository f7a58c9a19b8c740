"""Golden logits of a synthetic checkpoint, from HF transformers loading the same files.

The model is tests/golden/tiny-llama3.toml (llama-3.1-8b's features at test size: head dim 128,
4 query heads per KV head, untied LM head, llama3 RoPE scaling, padded vocabulary) with seed 0:
    cargo xtask synth-model tests/golden/tiny-llama3.toml --format hf --out DIR
    cargo xtask synth-model tests/golden/tiny-llama3.toml --out FILE.gguf
or tests/golden/tiny-qwen3.toml (Qwen3 dense's features), tests/golden/tiny-qwen3moe.toml
(Qwen3 MoE's: one safetensors tensor per expert, the hub's layout), tests/golden/tiny-qwen2.toml
(Qwen2's: Q/K/V biases), tests/golden/tiny-gemma3.toml (Gemma 3's) and tests/golden/tiny-phi3.toml
(Phi-3's fused projections) the same way, their goldens written with
    python make_synth_golden_hf.py DIR --out tests/golden/tiny_qwen3_hf
    python make_synth_golden_hf.py DIR --out tests/golden/tiny_qwen3moe_hf
    python make_synth_golden_hf.py DIR FILE.gguf --out tests/golden/tiny_qwen2_hf
    python make_synth_golden_hf.py DIR FILE.gguf --out tests/golden/tiny_gemma3_hf
    python make_synth_golden_hf.py DIR FILE.gguf --out tests/golden/tiny_phi3_hf
and tiny_mistral_hf from tiny-llama3's HF folder with its config.json made Mistral's (model_type
mistral, architectures [MistralForCausalLM], no rope_scaling, sliding_window 16; the edit
tests/tests/synth_model.rs makes):
    python make_synth_golden_hf.py DIR --out tests/golden/tiny_mistral_hf
and tiny_phi3_longrope_hf from tiny-phi3's HF folder with Phi-4-mini's kind of RoPE put in its
config.json (partial_rotary_factor 0.75, original_max_position_embeddings 64, rope_scaling
{"type": "longrope", "short_factor": [1 + i/8], "long_factor": [1 + i] for i < 24}; the edit
tests/tests/synth_model.rs makes, `phi3_longrope_config`):
    python make_synth_golden_hf.py DIR --out tests/golden/tiny_phi3_longrope_hf
and tiny_gpt_oss_hf / tiny_gpt_oss_mxfp4_hf from tests/golden/tiny-gpt-oss.toml's folders in bf16
and with `--quant mxfp4` (the experts as OpenAI's checkpoints hold them, which transformers
dequantises on a machine without its MXFP4 kernels; needs `accelerate`):
    python make_synth_golden_hf.py DIR --out tests/golden/tiny_gpt_oss_hf
    python make_synth_golden_hf.py DIR_MXFP4 --out tests/golden/tiny_gpt_oss_mxfp4_hf
(transformers' GGUF reader takes Gemma 3's defaults for the sliding-window pattern (6) and
query_pre_attn_scalar (256) rather than the file's 2 and the folder's 64, so its logits of that
GGUF differ from the folder's: recorded, not asserted; the test checks the GGUF against the folder
on the CPU backend instead)
Reference: HF transformers' model class of the folder's config (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM,
GptOssForCausalLM, and
MistralForCausalLM below) in float32, eager attention, on CPU, loading the HF folder
(bf16 safetensors widened to f32). Nobody in this project wrote it. The sequence is a
>= 100-token prompt followed by 16 teacher-forced tokens; the golden holds the logits of the prompt's
last position and of each of the 16 decode positions.

Usage (venv with torch, transformers, gguf, numpy):
    python make_synth_golden_hf.py DIR [FILE.gguf] [--out PREFIX] [--device cpu|cuda] [--prompt-tokens N]
--prompt-tokens N makes the prompt N tokens long (the prompt's tokens repeated), so that the decode
positions read N cached positions (the long-context check; only the checked positions' logits are
computed).
--out PREFIX writes PREFIX.json and PREFIX_last.f32 instead of the test's golden (any synthetic model:
the 8B ones on the GPU machine, checked with runtime/backend/examples/golden_check.rs); --device runs
the reference there (f32 throughout either way).
With FILE.gguf it also loads the GGUF through transformers' GGUF reader (gguf-py) and records how
far its logits are from the folder's (transformers' GGUF reader ignores rope_freqs, so the llama3
scaling is lost there; recorded, not asserted), and from the folder loaded without its rope scaling
(recorded: 0 means the GGUF's weights, q/k permutation included, are the folder's).
Writes, next to this script:
    tiny_llama3_hf.json         prompt, token ids, top-20 (id, logit) per checked position, versions,
                                the sha256 of model.safetensors (the test regenerates the file and
                                checks it is the same bytes)
    tiny_llama3_hf_last.f32     the full logits row of the last position, little-endian f32
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

PROMPT = ("The river runs past the old mill, where the miller's daughter counts sacks of grain each "
          "morning before the market opens. Travellers from the northern towns stop to water their "
          "horses, trade news of the harvest and argue about the price of salt, wool and iron. In "
          "winter the wheel freezes, the village gathers around one fire, and the stories grow longer "
          "with every telling, until nobody remembers which parts were true. The miller himself says "
          "little; he mends the sacks, oils the gears and listens.")
CONTINUATION = (" In spring the ice breaks, the water rises, the wheel turns again and the first "
                "boats come down from the hills.")
DECODE_STEPS = 16


def unscaled(d, ids):
    """The logits of folder d loaded without its rope scaling (what transformers' GGUF reader
    builds)."""
    cfg = AutoConfig.from_pretrained(d)
    theta = json.load(open(os.path.join(d, "config.json")))["rope_theta"]
    cfg.rope_scaling = None
    if hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    um = AutoModelForCausalLM.from_pretrained(d, config=cfg, torch_dtype=torch.float32,
                                              attn_implementation="eager")
    with torch.no_grad():
        return um(torch.tensor([ids])).logits[0].float().numpy()


def top20(checked):
    """Each row's 20 largest logits as [id, logit], largest first (ties: the lower id first)."""
    top = []
    for row in checked:
        order = np.argsort(-row, kind="stable")[:20]
        top.append([[int(i), float(row[i])] for i in order])
    return top


def main():
    argv = sys.argv[1:]
    out_prefix = None
    device = "cpu"
    if "--out" in argv:
        i = argv.index("--out")
        out_prefix = argv[i + 1]
        del argv[i:i + 2]
    if "--device" in argv:
        i = argv.index("--device")
        device = argv[i + 1]
        del argv[i:i + 2]
    prompt_tokens = None
    if "--prompt-tokens" in argv:
        i = argv.index("--prompt-tokens")
        prompt_tokens = int(argv[i + 1])
        del argv[i:i + 2]
    d = os.path.abspath(argv[0])
    here = os.path.dirname(os.path.abspath(__file__))
    if out_prefix is None:
        json_path = os.path.join(here, "tiny_llama3_hf.json")
        last_path = os.path.join(here, "tiny_llama3_hf_last.f32")
    else:
        json_path = out_prefix + ".json"
        last_path = out_prefix + "_last.f32"
    sha = hashlib.sha256(open(os.path.join(d, "model.safetensors"), "rb").read()).hexdigest()
    cfg_json = json.load(open(os.path.join(d, "config.json")))
    tok = AutoTokenizer.from_pretrained(d)
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    cont = tok(CONTINUATION, add_special_tokens=False)["input_ids"][:DECODE_STEPS]
    assert len(prompt) >= 100 and len(cont) == DECODE_STEPS, (len(prompt), len(cont))
    if prompt_tokens is not None:
        prompt = (prompt * (prompt_tokens // len(prompt) + 1))[:prompt_tokens]
    ids = prompt + cont
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32,
                                                 attn_implementation="eager").to(device)
    model.eval()
    with torch.no_grad():
        if prompt_tokens is None:
            logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
            # the prompt's last position, then each teacher-forced decode position
            checked = logits[len(prompt) - 1: len(prompt) - 1 + DECODE_STEPS + 1]
        else:
            # a long prompt: the LM head on the checked positions only (the whole [N, vocab] f32
            # logits would take N x 0.5 MB)
            hidden = model.model(torch.tensor([ids], device=device)).last_hidden_state[0]
            checked = model.lm_head(hidden[len(prompt) - 1:]).float().cpu().numpy()
            logits = None
    del model
    top = top20(checked)
    out = {
        "reference": "HF transformers %s, torch %s, float32 eager on %s, HF folder (bf16 safetensors)" % (
            transformers.__version__, torch.__version__, device),
        "model": {k: cfg_json.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "vocab_size",
                                                "rope_scaling", "tie_word_embeddings")},
        "safetensors_sha256": sha,
        "prompt": PROMPT,
        "continuation": CONTINUATION,
        "prompt_tokens": [int(i) for i in prompt],
        "decode_tokens": [int(i) for i in cont],
        "top20": top,
        "logit_std": float(checked.std()),
        "last_row_file": os.path.basename(last_path),
    }
    if len(argv) > 1 and logits is not None:
        g = os.path.abspath(argv[1])
        gm = AutoModelForCausalLM.from_pretrained(os.path.dirname(g), gguf_file=os.path.basename(g),
                                                  torch_dtype=torch.float32,
                                                  attn_implementation="eager")
        with torch.no_grad():
            gl = gm(torch.tensor([ids])).logits[0].float().numpy()
        out["gguf_via_transformers_max_abs_diff"] = float(np.abs(gl - logits).max())
        out["gguf_via_transformers_same_argmax"] = bool(
            (gl.argmax(-1) == logits.argmax(-1)).all())
        # the same folder without its rope scaling: what transformers' GGUF reader builds, so any
        # difference left is in the GGUF's weights (values, q/k permutation); not for configs
        # with RoPE per layer type (Gemma 3), which have no llama3 scaling to drop
        if "layer_types" in cfg_json:
            logits_unscaled = None
        else:
            logits_unscaled = unscaled(d, ids)
        if logits_unscaled is not None:
            out["gguf_via_transformers_vs_unscaled_folder_max_abs_diff"] = float(
                np.abs(gl - logits_unscaled).max())
    with open(json_path, "w") as fh:
        json.dump(out, fh, indent=None)
    checked[-1].astype("<f4").tofile(last_path)
    print("prompt tokens", len(prompt), "decode tokens", len(cont))
    print("logit std", checked.std(), "argmax", [int(np.argmax(r)) for r in checked])
    for k in ("gguf_via_transformers_max_abs_diff", "gguf_via_transformers_same_argmax",
              "gguf_via_transformers_vs_unscaled_folder_max_abs_diff"):
        if k in out:
            print(k, out[k])


if __name__ == "__main__":
    main()
