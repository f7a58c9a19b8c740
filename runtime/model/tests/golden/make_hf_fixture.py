#!/usr/bin/env python3
"""Write two tiny HF llama checkpoints for runtime/model/tests/hf_reader.rs.

  tests/fixtures/tiny-llama/          config.json + model.safetensors (tied embeddings, bf16 matrices,
                                      f32 norms, one f16 matrix) + tokenizer.json + tokenizer_config.json
  tests/fixtures/tiny-llama-sharded/  the same weights plus an lm_head, split over two shards listed in
                                      model.safetensors.index.json (untied embeddings)

The weights are random (numpy seed 0); the tokenizer is a byte-level BPE with the 256 byte tokens,
three ChatML control tokens and four merges ("h e", "l l", "he ll", "hell o"). Nothing here is
reference data: the Rust test checks structure (config normalisation, names, shapes, sharding) and the
Q/K permutation by recomputing RoPE attention scores in both conventions.

Run:  python3 runtime/model/tests/golden/make_hf_fixture.py
(with numpy and safetensors installed, e.g. in a venv: pip install numpy safetensors)
"""
import json
import os

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures")

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2
HEAD_DIM = HIDDEN // HEADS


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def tokenizer():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    b2u = bytes_to_unicode()
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    merges = ["h e", "l l", "he ll", "hell o"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    tok_cfg = {
        "add_bos_token": False,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                         "message['content'] | trim + '<|im_end|>\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "tokenizer_class": "GPT2Tokenizer",
    }
    return tok, tok_cfg, len(vocab)


def config(vocab, tied):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "tie_word_embeddings": tied,
        "vocab_size": vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def bf16(a):
    """float32 -> bfloat16 bits (round to nearest even), stored as uint16 then viewed by safetensors."""
    u = a.astype(np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) >> 16).astype(np.uint16)


def weights(vocab, rng):
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * 0.5,
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((HIDDEN, HEADS * HEAD_DIM)).astype(np.float32)
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((FFN, HIDDEN)).astype(np.float32)
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((FFN, HIDDEN)).astype(np.float32)
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((HIDDEN, FFN)).astype(np.float32)
    return w


def encode(w):
    """Store norms as f32, layer 1's v_proj as f16, every other matrix as bf16 (raw uint16 bits)."""
    out = {}
    for k, v in w.items():
        if v.ndim == 1:
            out[k] = v
        elif k == "model.layers.1.self_attn.v_proj.weight":
            out[k] = v.astype(np.float16)
        else:
            out[k] = bf16(v)
    return out


def write_dir(path, cfg, tok, tok_cfg):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)


def main():
    rng = np.random.default_rng(0)
    tok, tok_cfg, vocab = tokenizer()
    w = encode(weights(vocab, rng))

    single = os.path.join(FIX, "tiny-llama")
    write_dir(single, config(vocab, True), tok, tok_cfg)
    # safetensors.numpy cannot tag uint16 as BF16: write them as U16, then patch the header's dtype.
    save_bf16(os.path.join(single, "model.safetensors"), w)

    sharded = os.path.join(FIX, "tiny-llama-sharded")
    write_dir(sharded, config(vocab, False), tok, tok_cfg)
    w2 = dict(w)
    w2["lm_head.weight"] = bf16(rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * 0.5)
    names = sorted(w2)
    shard_of = {n: (1 if n.startswith("model.layers.1.") or n == "lm_head.weight" else 0) for n in names}
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, fn in enumerate(files):
        save_bf16(os.path.join(sharded, fn), {n: w2[n] for n in names if shard_of[n] == i})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in w2.values()))},
             "weight_map": {n: files[shard_of[n]] for n in names}}
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def save_bf16(path, tensors):
    save_file(tensors, path)
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] == "U16":
            v["dtype"] = "BF16"
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)  # data_offsets are relative to the data section: any length works
    with open(path, "wb") as f:
        f.write(len(new).to_bytes(8, "little") + new + data[8 + n:])


if __name__ == "__main__":
    main()
