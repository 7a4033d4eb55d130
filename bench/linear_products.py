"""The CPU worker's linear products three ways, side by side: torch's ``F.linear`` on the weight as
loaded, oneDNN's packed layout (``PackedLinear``) and the native column blocks (``BlockedLinear``,
``worker/native/blocked_linear.c``), float32, one thread.

    .venv/bin/python bench/linear_products.py [--repeat 3]

Each shape (SmolLM2's projections, MLP and LM head at decode's row counts and at a prefill's, the tiny
model's LM head) is timed over enough distinct weights that they are not in cache (about 200 MB
cycled; at least two), as in a decode step, which reads every weight once. The fastest of ``--repeat``
passes is kept; ms per product, the weight read rate (GB/s) or the compute rate (GFLOP/s, at 64 rows
and more), and blocks / oneDNN.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from trioserve.worker.native_kernels import NativeKernels, build
from trioserve.worker.packed_linear import BlockedLinear, PackedLinear

# (rows, in, out, what)
SHAPES = (
    (1, 576, 1536, "SmolLM2 MLP up"),
    (8, 576, 1536, "SmolLM2 MLP up"),
    (32, 576, 1536, "SmolLM2 MLP up"),
    (8, 1536, 576, "SmolLM2 MLP down"),
    (8, 576, 576, "SmolLM2 q/o"),
    (8, 576, 192, "SmolLM2 k/v"),
    (8, 576, 49152, "SmolLM2 LM head"),
    (32, 576, 49152, "SmolLM2 LM head"),
    (1024, 576, 1536, "prefill MLP up"),
    (1024, 1536, 576, "prefill MLP down"),
    (32, 64, 49152, "tiny LM head"),
    (128, 64, 49152, "tiny LM head"),
)
CYCLED_BYTES = 200 << 20


def timed(layers: list[nn.Module], x: torch.Tensor, repeat: int) -> float:
    """Fastest pass of ``repeat``, ms per product; one product per layer per pass."""
    best = float("inf")
    for _ in range(repeat + 1):  # the first pass warms up
        start = time.perf_counter()
        for layer in layers:
            layer(x)
        best = min(best, (time.perf_counter() - start) / len(layers))
    return best * 1e3


def rate(rows: int, k: int, n: int, ms: float) -> str:
    if rows >= 64:
        return f"{2 * rows * k * n / ms / 1e6:.0f} GFLOP/s"
    return f"{4 * k * n / ms / 1e6:.1f} GB/s"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = NativeKernels(build())
    print(f"load average (start): {os.getloadavg()}", file=sys.stderr)
    print(
        "| rows x in -> out | what | F.linear, ms | oneDNN packed, ms | column blocks, ms | blocks / oneDNN |"
    )
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows, k, n, what in SHAPES:
            count = max(2, CYCLED_BYTES // (4 * k * n))
            plain = [nn.Linear(k, n, bias=False) for _ in range(count)]
            onednn = [PackedLinear(layer) for layer in plain]
            blocks = [BlockedLinear(layer, kernels) for layer in plain]
            x = torch.randn(rows, k)
            torch.testing.assert_close(blocks[0](x), F.linear(x, plain[0].weight), rtol=1e-4, atol=1e-4)
            t_plain = timed(list(plain), x, args.repeat)
            t_onednn = timed(list(onednn), x, args.repeat)
            t_blocks = timed(list(blocks), x, args.repeat)
            cells = [
                f"{rows} x {k} -> {n}",
                what,
                f"{t_plain:.3f}",
                f"{t_onednn:.3f} ({rate(rows, k, n, t_onednn)})",
                f"{t_blocks:.3f} ({rate(rows, k, n, t_blocks)})",
                f"{t_onednn / t_blocks:.2f}",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
            del plain, onednn, blocks
    print(f"load average (end): {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
