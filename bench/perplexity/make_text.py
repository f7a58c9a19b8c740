"""The fixed text bench/perplexity/ measures perplexity on: text.txt, written by this script.

Source: the Python Language Reference's topics as CPython ships them in its standard library
(`pydoc_data/topics.py`, the text `help()` prints), CPython 3.11.7. Licence: the Python
documentation is distributed under the PSF License Agreement (Python Software Foundation;
https://docs.python.org/3/license.html); this is an unmodified excerpt, with that notice.

The topics in sorted order, separated by blank lines, until the text passes 120,000 characters
(~30,000 tokens of a byte-level BPE such as SmolLM2's; llama.cpp's llama-perplexity needs at least
2 x its context in tokens). Usage: python3 make_text.py (from any directory).
"""
import os
import sys

import pydoc_data.topics as t

out = []
for k in sorted(t.topics):
    out.append(t.topics[k].strip())
    if sum(len(s) + 2 for s in out) > 120_000:
        break
text = "\n\n".join(out) + "\n"
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "text.txt")
with open(path, "w", encoding="utf-8") as f:
    f.write(text)
print(f"{path}: {len(text)} characters from {len(out)} topics, Python {sys.version.split()[0]}")
