#!/usr/bin/env python3
"""Golden token ids from llama.cpp's tokenizer (llama-tokenize) on the real default GGUF.

Reference: llama.cpp vendored in the llama-cpp-python 0.3.36 sdist, built for the CPU (its
llama-tokenize; docs/facts.md, "Peer on the H200", says how that source is fetched and built). For
every case the text goes to llama-tokenize on stdin, byte for byte (--stdin --no-escape), without BOS
(--no-bos), with or without special-token parsing (--no-parse-special), and the printed ids (--ids)
are recorded. The Rust test
(tests/tokenizer_golden.rs) asserts Tokenizer::encode(text, add_bos=false, parse_special) equals them.

Usage: make_tokenizer_golden.py LLAMA_TOKENIZE MODEL_GGUF
  or set METRALE_LLAMA_TOKENIZE (path of llama.cpp's llama-tokenize, in its build's bin/ folder, next
  to llama-cli) and METRALE_MODEL (path of SmolLM2-135M-Instruct.Q4_1.gguf) instead of the arguments.
Writes tokenizer_llamacpp.json next to this script.
"""
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("METRALE_LLAMA_TOKENIZE")
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("METRALE_MODEL")
if not TOK or not MODEL:
    sys.exit("usage: make_tokenizer_golden.py LLAMA_TOKENIZE MODEL_GGUF (or set METRALE_LLAMA_TOKENIZE "
             "and METRALE_MODEL): llama.cpp's llama-tokenize and SmolLM2-135M-Instruct.Q4_1.gguf")

# (text, parse_special)
CASES = [
    ("Hello world", False),
    ("What is the capital of France? Answer in one sentence.", False),
    (" leading space and trailing space ", False),
    ("multiple   spaces    between\twords\t\ttabs", False),
    ("line one\nline two\n\nline four\r\nwindows line\n", False),
    ("\n\n\n", False),
    ("    ", False),
    ("", False),
    ("1234567890", False),
    ("The year 2024 had 366 days; pi = 3.14159265358979", False),
    ("12,345,678.90 and -0.5e-10 and 0x1F and 1_000_000", False),
    ("99999999999999999999999999999999", False),
    ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n", False),
    ("fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{v:?}\"); }", False),
    ("<div class=\"a\">&amp; &lt;tag&gt;</div>", False),
    ("SELECT * FROM users WHERE id = 42 AND name LIKE '%o''brien%';", False),
    ("Café naïve façade résumé coöperate Ångström", False),
    ("Zürich, São Paulo, Kraków, İstanbul, Ελληνικά, Русский текст", False),
    ("日本語のテキストと中文文本，还有한국어 텍스트。", False),
    ("Emoji: 🦀🚀👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷", False),
    ("Math: ∑_{i=1}^{n} x² ≤ ∞, α+β=γ, ½ ¾ ⅔", False),
    ("Arabic مرحبا بالعالم and Hebrew שלום עולם", False),
    ("I'm sure they'll say it's fine; we've done what you'd do. DON'T SHOUT I'M", False),
    ("ALLCAPS lowercase MiXeD camelCaseWord snake_case_word kebab-case-word", False),
    ("https://example.com/path?query=1&b=two#frag user@example.org", False),
    ("!!!??? ... --- *** ### $$$ %%% ^^^ ((())) [[]] {{}}", False),
    ("   indented\n\t\ttabbed\n \n  \n", False),
    ("a\u00a0b\u2009c\u3000d", False),
    ("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", False),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n", True),
    ("text<|endoftext|>more text", True),
    ("text<|endoftext|>more text", False),
    ("<|im_end|><|im_end|>  <|im_start|>", True),
    ("<repo_name>metrale<file_sep>src/main.rs", True),
    ("The quick brown fox jumps over the lazy dog. " * 4, False),
    ("Supercalifragilisticexpialidocious antidisestablishmentarianism", False),
    ("tokenization's edge-cases: don't, won't, can't, y'all, 'quoted', \"double\"", False),
    ("\u200b zero width \ufeff BOM \u0301 combining", False),
    ("numbers 1st 2nd 3rd 4th 10k 3.5GB v1.2.3 2024-01-01T12:00:00Z", False),
]


# Random mixes of tricky pieces (seeded, so the file is reproducible): whitespace runs next to letters,
# digits next to spaces, apostrophes, accents, CJK, emoji, special-token text.
PIECES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "a", "the", "The", "Hello", "ing", "'s", "'ll",
          "'T", "0", "7", "42", "2024", "3.14", ",", ".", "!", "?", "...", "--", "(", ")", "{", "}", "\"", "é",
          "ñ", "ü", "ß", "中", "文字", "日本", "한", "🦀", "👍🏽", "🇫🇷", "α", "Ω", "∑", "€", "$", "#", "@", "_",
          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<", "|", ">", "x\u00a0y", "\u200b"]


def random_cases(n, seed=20241130):
    import random
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 24)))
        out.append((text, i % 3 == 0))
    return out


CASES += random_cases(80)


def llama_tokenize(text, parse_special):
    cmd = [TOK, "-m", MODEL, "--stdin", "--no-escape", "--ids", "--no-bos", "--log-disable"]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, input=text.encode("utf-8"), capture_output=True, check=True).stdout.decode()
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def version():
    cli = os.path.join(os.path.dirname(TOK), "llama-cli")
    r = subprocess.run([cli, "--version"], capture_output=True, text=True)
    v = " ".join((r.stdout + r.stderr).split())
    # the sdist has no git metadata, so llama.cpp reports "commit unknown": add ggml's own version
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(TOK))))
    ggml = {}
    try:
        for line in open(os.path.join(src, "ggml", "CMakeLists.txt")):
            for part in ("MAJOR", "MINOR", "PATCH"):
                if line.startswith(f"set(GGML_VERSION_{part} "):
                    ggml[part] = line.split()[1].rstrip(")")
    except OSError:
        pass
    if len(ggml) == 3:
        v += f"; ggml {ggml['MAJOR']}.{ggml['MINOR']}.{ggml['PATCH']}"
    return v


def main():
    sha = hashlib.sha256(open(MODEL, "rb").read()).hexdigest()
    cases = [{"text": t, "parse_special": ps, "ids": llama_tokenize(t, ps)} for t, ps in CASES]
    doc = {
        "reference": "llama.cpp llama-tokenize --stdin --no-escape --ids --no-bos [--no-parse-special]",
        "llama_cpp_source": "llama-cpp-python==0.3.36 sdist (vendor/llama.cpp), CPU build",
        "llama_cpp_version": version(),
        "model": os.path.basename(MODEL),
        "model_sha256": sha,
        "made_by": "runtime/model/tests/golden/make_tokenizer_golden.py",
        "cases": cases,
    }
    with open(os.path.join(HERE, "tokenizer_llamacpp.json"), "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    print(f"{len(cases)} cases written; {doc['llama_cpp_version']}")


if __name__ == "__main__":
    main()
