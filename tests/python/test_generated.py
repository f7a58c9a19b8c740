"""Generated sources in the tree are what their generator writes today.

kernels/cuda/wgmma.cuh (the wgmma.mma_async wrappers, one operand list per instruction width) is
written by kernels/cuda/gen_wgmma.py: a hand edit of the header, or a generator change without
regenerating it, fails here and names the command that fixes it.
"""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_wgmma_header_is_what_its_generator_writes():
    gen = REPO / "kernels/cuda/gen_wgmma.py"
    out = subprocess.run([sys.executable, str(gen)], capture_output=True, text=True, check=True).stdout
    have = (REPO / "kernels/cuda/wgmma.cuh").read_text()
    assert out == have, (
        "kernels/cuda/wgmma.cuh differs from what gen_wgmma.py writes; "
        "run: python3 kernels/cuda/gen_wgmma.py > kernels/cuda/wgmma.cuh"
    )
