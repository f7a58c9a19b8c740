"""Byte-level BPE vocabularies in GGUF form under the pre-tokenizers `tekken`, `dbrx` and `gpt-4o`, and their
reference tokenizations by Hugging Face `tokenizers` (the implementation those models' own
tokenizer.json files run on; nobody in this project wrote it).

GGUF files of Mistral-Nemo / Mistral Small 3 say `tokenizer.ggml.pre = "tekken"`, Phi-4's say
`"dbrx"`, gpt-oss's `"gpt-4o"` (o200k; Llama 4's say `"llama4"`, the same). Their real vocabularies are not in any package this project can install, so this
script trains a vocabulary of 4,000 tokens on bench/perplexity/text.txt (CPython's pydoc topics,
PSF licence) under each pre-tokenizer as the real tokenizer.json files configure it:
  - tekken: Mistral's split regex (case runs within words, single digits), byte-level BPE with
    `ignore_merges` (a whole piece found in the vocabulary is one token);
  - dbrx: the llama3 split regex, byte-level BPE with merges as usual;
  - gpt-4o: o200k's split regex as gpt-oss's tokenizer.json writes it (case runs within words with
    their contractions, digits in threes), byte-level BPE with merges as usual.
Written next to this script:
    bpe_tekken.gguf, bpe_dbrx.gguf, bpe_gpt-4o.gguf   vocabulary-only GGUF files (gguf-py's writer)
    bpe_golden.json                  the strings, each vocabulary's ids for them, and the pieces
                                     Mistral's split regex cuts each string into (a vocabulary
                                     trained under a regex rarely shows which regex splits it)
Usage (a venv with tokenizers and gguf): python make_bpe_golden.py
"""
import importlib.metadata
import json
import os

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "..", "..", "bench", "perplexity", "text.txt")
# as the models' tokenizer.json files write them
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
STRINGS = [
    "Hello world",
    " Hello world",
    "helloWorld HTTPServer getHTTPResponseCode",
    "   leading and trailing   ",
    "def f(x):\n    return x + 1\n",
    "The quick brown fox jumps over the lazy dog.",
    "numbers 1234567890 and 3.14159",
    "naïve café résumé Ünïcödé",
    "emoji 🙂 and 中文 text",
    "path/to/file.py // comment\n\n",
    "I'm sure you've SEEN it, they'll say; DON'T",
    "a",
    " ",
    "",
    "tabs\tand\ttabs\r\nCRLF",
    "camelCaseVariableName = getValue()",
    "2024-12-05 at 10:30, 1000000 rows",
    "XMLHttpRequest and JSONParser",
    "see https://example.com/a/b?c=1",
    "McDonald's iPhone eBay",
]


def build(name, regex, ignore_merges):
    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([TEXT], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    merges = spec["model"]["merges"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    w = gguf.GGUFWriter(os.path.join(HERE, name + ".gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(name.split("_", 1)[1])
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in ("<s>", "</s>") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [tok.encode(s, add_special_tokens=False).ids for s in STRINGS]


def main():
    out = {
        "tokenizers": importlib.metadata.version("tokenizers"),
        "gguf": importlib.metadata.version("gguf"),
        "strings": STRINGS,
        "bpe_tekken": build("bpe_tekken", TEKKEN, True),
        "bpe_dbrx": build("bpe_dbrx", LLAMA3, False),
        "bpe_gpt-4o": build("bpe_gpt-4o", O200K, False),
        "tekken_pieces": [[p for p, _ in pre_tokenizers.Split(Regex(TEKKEN), behavior="isolated").pre_tokenize_str(s)]
                          for s in STRINGS],
        "gpt-4o_pieces": [[p for p, _ in pre_tokenizers.Split(Regex(O200K), behavior="isolated").pre_tokenize_str(s)]
                          for s in STRINGS],
    }
    with open(os.path.join(HERE, "bpe_golden.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
