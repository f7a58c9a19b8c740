#!/usr/bin/env python3
"""Markdown tables of spec_bench reports (runtime/backend/examples/spec_bench.rs --out FILE.json).

    python3 bench/spec/table.py FILE.json [FILE.json ...]

One table per file: each corruption rate's tok/s, its ratio to the plain greedy decode of the same
run, the share of proposals accepted, tokens a verification step, the step's time against a plain
step's, and whether the tokens equal the plain run's.
"""
import json
import sys


def table(path):
    r = json.load(open(path))
    out = [f"`{path}`: {r['backend']}, k = {r['k']}, {r['tokens']} tokens after a "
           f"{r['prompt_tokens']}-token prompt, medians of {r['reps']}; plain "
           f"{r['plain_tok_s']:.1f} tok/s ({1e3 * r['plain_step_ms']:,.0f} us a step)",
           "",
           "| proposals corrupted | tok/s | vs plain | accepted | tokens a step | step | step vs plain | tokens equal to plain (or where they part, the plain pick's top-2 logit margin there) |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for x in r["runs"]:
        if "partings" in x:  # since 2026-12-07: each repetition's partings, re-synchronised
            ps = [p for rep in x["partings"] for p in rep]
            equal = "every repetition" if not ps else \
                f"{len(ps)} partings in {r['reps']} repetitions: " + \
                ", ".join(f"token {j} (margin {m:.4f})" for j, m in ps)
        else:
            equal = "yes" if x["parts_at"] is None else f"parts at token {x['parts_at']}"
        out.append(f"| {100 * x['corrupted']:.0f}% | {x['tok_s']:,.1f} | {x['speedup']:.2f}x | "
                   f"{100 * x['acceptance']:.1f}% | {x['tokens_per_step']:.2f} | "
                   f"{1e3 * x['step_ms']:,.0f} us | {x['step_over_plain']:.2f}x | {equal} |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n\n".join(table(p) for p in sys.argv[1:]))
