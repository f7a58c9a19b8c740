"""How close a Qwen3-MoE checkpoint's routing comes to a tie on a golden's prompt, and what a flip
of the closest choice does to the logits, from HF transformers (f32, CPU) on the same HF folder.

A router that takes the top k experts is discontinuous: where the k-th and (k+1)-th logits of a
token lie closer than the rounding of its input, two correct implementations may choose
differently, and that token's output then moves by a whole expert's share. This prints, for each
layer, the gap between each token's k-th and (k+1)-th router logits at the prompt (the smallest
five and the last token's), and the largest change over the golden's top-20 at the prompt's last
position when the last layer's k-th and (k+1)-th experts of the last token trade places (their
router rows swapped). A backend whose prompt logits differ from the golden by about that much,
while its decode positions agree, has flipped that choice.

    python moe_router_margins.py HF_DIR GOLDEN.json

HF_DIR: `cargo xtask synth-model qwen3-30b-a3b --layers 2 --format hf` (or any Qwen3MoeForCausalLM
folder); GOLDEN.json: make_synth_golden_hf.py's output for it (its prompt_tokens and top20).
Needs torch and transformers.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: moe_router_margins.py HF_DIR GOLDEN.json")
    golden = json.load(open(sys.argv[2]))
    ids = torch.tensor([golden["prompt_tokens"]])
    n = ids.shape[1]
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    model.eval()
    k = model.config.num_experts_per_tok
    last = model.model.layers[-1].mlp
    seen = {}
    hook = last.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    hook.remove()
    base = out.logits[0, -1]
    for layer, logits in enumerate(out.router_logits):
        s, _ = torch.sort(logits.reshape(n, -1).float(), -1, descending=True)
        gap = s[:, k - 1] - s[:, k]
        order = torch.argsort(gap)[:5].tolist()
        print(f"layer {layer}: gap between the {k}th and {k + 1}th router logits, last token "
              f"{gap[-1].item():.3e}; smallest at tokens {order}: "
              + ", ".join(f"{gap[i].item():.2e}" for i in order))
    # the last token's k-th and (k+1)-th experts in the last layer trade places
    w = last.gate.weight.data
    logits = w @ seen["x"].reshape(n, -1)[-1]
    s, idx = torch.sort(logits, descending=True)
    ek, ek1 = idx[k - 1].item(), idx[k].item()
    swapped = w.clone()
    swapped[[ek, ek1]] = w[[ek1, ek]]
    last.gate.weight.data = swapped
    with torch.no_grad():
        flip = model(ids).logits[0, -1]
    last.gate.weight.data = w
    top = [t for t, _ in golden["top20"][0]]
    print(f"last layer, last token: experts {ek} ({s[k - 1].item():.6f}) and {ek1} "
          f"({s[k].item():.6f}) trade places: the prompt's last logits move by "
          f"{(flip[top] - base[top]).abs().max().item():.4f} over the golden's top-20 "
          f"(this run against the golden: "
          f"{max(abs(base[t].item() - v) for t, v in golden['top20'][0]):.2e})")


if __name__ == "__main__":
    main()
