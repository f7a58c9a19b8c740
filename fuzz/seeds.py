#!/usr/bin/env python3
"""Writes the checked-in seed corpus of metrale's fuzz targets into corpus/<target>/seed-*.

Deterministic (no randomness, no downloads): run it again after changing a seed and commit the
result. The GGUF writer mirrors runtime/model/tests/common/mod.rs (a valid tiny llama, here one
layer of hidden 32 so the seed stays small); the safetensors files are written by hand (8-byte
little-endian header length, JSON header, data). The whole corpus stays far under 1 MB.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# ---- gguf ---------------------------------------------------------------------------------------

def gstr(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, t, payload):
    return gstr(key) + struct.pack("<I", t) + payload


def arr(t, items):
    return struct.pack("<IQ", t, len(items)) + b"".join(items)


def gguf(kvs, tensors, alignment=32):
    """tensors: (name, dims, ggml_type, data)"""
    o = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    off = 0
    offsets = []
    for name, dims, ty, data in tensors:
        o += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        o += struct.pack("<IQ", ty, off)
        offsets.append(off)
        off += (len(data) + alignment - 1) // alignment * alignment
    o += b"\0" * (-len(o) % alignment)
    base = len(o)
    for (_, _, _, data), off in zip(tensors, offsets):
        o += b"\0" * (base + off - len(o)) + data
    return o


def byte_char(b):
    def printable(x):
        return 0x21 <= x <= 0x7E or 0xA1 <= x <= 0xAC or 0xAE <= x <= 0xFF
    if printable(b):
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if not printable(x)))


def tiny_llama():
    hidden, ffn = 32, 32
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [byte_char(b) for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    u32 = lambda v: struct.pack("<I", v)
    kvs = [
        kv("general.architecture", 8, gstr("llama")),
        kv("general.name", 8, gstr("seed")),
        kv("llama.block_count", 4, u32(1)),
        kv("llama.embedding_length", 4, u32(hidden)),
        kv("llama.attention.head_count", 4, u32(1)),
        kv("llama.attention.head_count_kv", 4, u32(1)),
        kv("llama.feed_forward_length", 4, u32(ffn)),
        kv("llama.context_length", 4, u32(64)),
        kv("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
        kv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
        kv("tokenizer.ggml.model", 8, gstr("gpt2")),
        kv("tokenizer.ggml.pre", 8, gstr("smollm")),
        kv("tokenizer.ggml.tokens", 9, arr(8, [gstr(t) for t in tokens])),
        kv("tokenizer.ggml.token_type", 9, arr(5, [struct.pack("<i", t) for t in types])),
        kv("tokenizer.ggml.merges", 9, arr(8, [gstr(m) for m in merges])),
        kv("tokenizer.ggml.bos_token_id", 4, u32(1)),
        kv("tokenizer.ggml.eos_token_id", 4, u32(2)),
        kv("tokenizer.ggml.add_bos_token", 7, b"\0"),
        kv("tokenizer.chat_template", 8, gstr(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")),
    ]
    q4_0 = lambda n_in, n_out: bytes(((i * 7) % 251 for i in range(n_in // 32 * 18 * n_out)))
    f32_ones = lambda n: struct.pack("<%df" % n, *([1.0] * n))
    q8_0 = lambda n_in, n_out: bytes(((i * 3) % 251 for i in range(n_in // 32 * 34 * n_out)))
    t = [
        ("token_embd.weight", [hidden, len(tokens)], 8, q8_0(hidden, len(tokens))),
        ("output_norm.weight", [hidden], 0, f32_ones(hidden)),
        ("blk.0.attn_norm.weight", [hidden], 0, f32_ones(hidden)),
        ("blk.0.ffn_norm.weight", [hidden], 0, f32_ones(hidden)),
    ]
    for name, n_in, n_out in [("attn_q", hidden, hidden), ("attn_k", hidden, hidden),
                              ("attn_v", hidden, hidden), ("attn_output", hidden, hidden),
                              ("ffn_gate", hidden, ffn), ("ffn_up", hidden, ffn),
                              ("ffn_down", ffn, hidden)]:
        t.append(("blk.0.%s.weight" % name, [n_in, n_out], 2, q4_0(n_in, n_out)))
    return gguf(kvs, t)


def every_type():
    """One key of every metadata type, nested arrays, alignment 64, one F32 tensor."""
    kvs = [
        kv("u8", 0, b"\xc8"), kv("i8", 1, b"\xfb"), kv("u16", 2, struct.pack("<H", 60000)),
        kv("i16", 3, struct.pack("<h", -30000)), kv("u32", 4, struct.pack("<I", 4000000000)),
        kv("i32", 5, struct.pack("<i", -7)), kv("f32", 6, struct.pack("<f", 1.5)),
        kv("bool", 7, b"\x01"), kv("string", 8, gstr("héllo")),
        kv("u64", 10, struct.pack("<Q", 2**64 - 1)), kv("i64", 11, struct.pack("<q", -2**63)),
        kv("f64", 12, struct.pack("<d", 0.25)),
        kv("arr_u32", 9, arr(4, [struct.pack("<I", v) for v in (1, 2, 3)])),
        kv("arr_bool", 9, arr(7, [b"\0", b"\1"])),
        kv("arr_f64", 9, arr(12, [struct.pack("<d", 0.5)])),
        kv("nested", 9, arr(9, [arr(8, [gstr("a"), gstr("b")]), arr(8, [gstr("c")])])),
        kv("general.alignment", 4, struct.pack("<I", 64)),
    ]
    return gguf(kvs, [("t", [2, 3], 0, struct.pack("<6f", *range(6)))], alignment=64)


put("gguf", "tiny-llama.gguf", tiny_llama())
put("gguf", "every-type.gguf", every_type())
put("gguf", "header-only.gguf", gguf([kv("general.architecture", 8, gstr("llama"))], []))

# ---- hf_config ----------------------------------------------------------------------------------

put("hf_config", "tiny-config.json", json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "vocab_size": 263, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}, indent=2))
put("hf_config", "smollm2-config.json", json.dumps({
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
    "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "use_cache": True, "vocab_size": 49152}))
put("hf_config", "llama3-rope-config.json", json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 1, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}))


def safetensors(tensors):
    """tensors: (name, dtype, shape, data)"""
    header, data = {}, b""
    for name, dtype, shape, blob in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


f32 = lambda n: struct.pack("<%df" % n, *[i / 8 for i in range(n)])
half = lambda n: bytes((i * 5) % 256 for i in range(2 * n))
put("hf_config", "llama.safetensors", safetensors([
    ("model.embed_tokens.weight", "BF16", [6, 4], half(24)),
    ("model.layers.0.input_layernorm.weight", "F32", [4], f32(4)),
    ("model.layers.0.self_attn.q_proj.weight", "F32", [4, 4], f32(16)),
    ("model.layers.0.self_attn.k_proj.weight", "F16", [2, 4], half(8)),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", "F32", [2], f32(2)),
    ("model.norm.weight", "F32", [4], f32(4)),
    ("lm_head.weight", "F16", [6, 4], half(24)),
]))
put("hf_config", "unknown-tensor.safetensors", safetensors([
    ("vision_tower.patch_embed.weight", "F32", [2, 2], f32(4)),
]))

# ---- request_json -------------------------------------------------------------------------------

for name, body in [
    ("chat-minimal", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
    ("chat-full", {
        "model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None}],
        "max_completion_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "n": 2, "stop": ["\n\n", "User:"], "seed": 42, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3,
        "logit_bias": {"17": -100, "42": 5.5}, "response_format": {"type": "text"}, "tools": [],
        "user": "u"}),
    ("completion-text", {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "stop": "."}),
    ("completion-tokens", {"prompt": [[1, 2, 3], [4, 5]], "logprobs": 2, "echo": False,
                           "suffix": "", "best_of": 1, "ignore_eos": True}),
    ("tokenize", {"content": "hello world", "add_special": True}),
    ("detokenize", {"tokens": [1, 2, 999]}),
]:
    put("request_json", name + ".json", json.dumps(body))

# ---- chat_template ------------------------------------------------------------------------------
# template, then NUL-separated role and content fields (see fuzz_targets/chat_template.rs)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}")
LLAMA3ISH = (
    "{{ bos_token }}{% for m in messages %}{% set c = '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' %}{{ c }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
STRICT = (
    "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}"
    "{% endif %}{% for m in messages %}{{ m.role.upper() }}: {{ m.content.strip() }}\n{% endfor %}"
    "{{ eos_token if not add_generation_prompt else '' }}")
for name, tpl, msgs in [
    ("smollm2", SMOLLM2, ["user", "What is 2+2?", "assistant", "4"]),
    ("smollm2-system", SMOLLM2, ["system", "Be brief.", "user", "Hi"]),
    ("llama3ish", LLAMA3ISH, ["user", "  hello  "]),
    ("strict", STRICT, ["user", "a", "assistant", "b", "user", "c"]),
    ("strftime", "{{ strftime_now('%d %B %Y') }} {{ messages|length }}", ["user", "x"]),
]:
    put("chat_template", name, "\0".join([tpl] + msgs))
