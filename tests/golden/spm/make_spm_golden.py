"""SentencePiece vocabularies in GGUF form and their reference tokenizations.

GGUF files of Llama 2, Mistral and Gemma carry a SentencePiece vocabulary (`tokenizer.ggml.model
= "llama"`: pieces, scores, token types; no merges). This script makes two such vocabularies the
way those models' tokenizers are made, and records how Google's `sentencepiece` (the reference
implementation, nobody in this project wrote it) tokenizes a set of strings with them:
  - spm_llama: BPE, byte fallback, a space prefixed to the text (`add_dummy_prefix`), identity
    normalisation, whitespace kept (Llama 2's and Mistral's settings);
  - spm_gemma: the same without the space prefix (Gemma's; GGUF `tokenizer.ggml.add_space_prefix
    = false`).
Each is trained on bench/perplexity/text.txt (CPython's pydoc topics, PSF licence) with 1,000
pieces, so that many strings need several merges and byte fallback. Written next to this script:
    spm_llama.gguf, spm_gemma.gguf    vocabulary-only GGUF files (gguf-py's writer)
    spm_golden.json                   the strings and each vocabulary's ids for them
Usage (a venv with sentencepiece and gguf): python make_spm_golden.py
"""
import importlib.metadata
import json
import os
import sys

import gguf
import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "..", "..", "bench", "perplexity", "text.txt")
STRINGS = [
    "Hello world",
    " Hello world",
    "Hello  world",
    "   leading and trailing   ",
    "def f(x):\n    return x + 1\n",
    "The quick brown fox jumps over the lazy dog.",
    "numbers 1234567890 and 3.14159",
    "naïve café résumé",
    "emoji 🙂 and 中文 text",
    "\n\n",
    "a",
    " ",
    "",
    "import os, sys; print(sys.argv[1:])",
    "tabs\tand\ttabs",
]


def train(name, dummy_prefix):
    prefix = os.path.join(HERE, name)
    spm.SentencePieceTrainer.train(
        input=TEXT, model_prefix=prefix, vocab_size=1000, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, add_dummy_prefix=dummy_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=False, input_sentence_size=200000, shuffle_input_sentence=False,
        max_sentence_length=16384, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    w = gguf.GGUFWriter(prefix + ".gguf", "llama")
    w.add_tokenizer_model("llama")
    toks, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        toks.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(dummy_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.remove(prefix + ".model")
    os.remove(prefix + ".vocab")
    return [sp.encode(s) for s in STRINGS]


def main():
    out = {
        "reference": "sentencepiece %s (Google's), gguf-py %s" % (
            spm.__version__, importlib.metadata.version("gguf")),
        "strings": STRINGS,
        "spm_llama": train("spm_llama", True),
        "spm_gemma": train("spm_gemma", False),
    }
    with open(os.path.join(HERE, "spm_golden.json"), "w") as fh:
        json.dump(out, fh, ensure_ascii=False)


if __name__ == "__main__":
    sys.exit(main())
