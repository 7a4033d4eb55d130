"""Tokens/s with ``-tp 1`` and ``-tp 2`` side by side, alternating, on a tiny random Llama
(docs/architecture.md, "Tensor parallelism"): one greedy stream of 128 tokens, then 8 concurrent
streams of 64, each rank on one torch thread.

    .venv/bin/python bench/tp_throughput.py [--rounds 2] [--hidden 64] [--layers 2]

Prints the machine's load average before and after: rerun when it is not quiet.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from frontend_cost import free_port, managed, spawn, wait_healthy
from prefix_dispatch import build_model


def complete(port: int, max_tokens: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        body = {"prompt": "hello world", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    tokens: int = reply["usage"]["completion_tokens"]
    return tokens


def measure(model: Path, tp: int, logs: Path) -> tuple[float, float]:
    """(one stream's tokens/s, 8 streams' tokens/s) against a fresh server with ``-tp tp``."""
    port = free_port()
    argv = [
        sys.executable, "-m", "trioserve", "serve", "--engine", "model", str(model), "--port", str(port),
        "--kv-cache-gib", "0.05", "-tp", str(tp), "--worker-threads", "1",
    ]  # fmt: skip
    with managed([]) as procs:
        server = spawn(f"tp{tp}-{time.monotonic_ns()}", argv, None, logs)
        procs.append(server)
        wait_healthy(server, port, 300)
        complete(port, 8)  # warm-up
        start = time.perf_counter()
        one = complete(port, 128) / (time.perf_counter() - start)
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            many = sum(pool.map(lambda _: complete(port, 64), range(8))) / (time.perf_counter() - start)
    return one, many


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="-tp 1 then -tp 2, this many times")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(f"[bench] load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        model, logs = Path(tmp) / "model", Path(tmp)
        build_model(model, args.hidden, args.layers, 512)
        rows = [(tp, *measure(model, tp, logs)) for _ in range(args.rounds) for tp in (1, 2)]
    print(f"[bench] load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)
    print(f"tiny random Llama, hidden {args.hidden}, {args.layers} layers; one torch thread per rank")
    print("| -tp | 1 stream (128 tokens), tokens/s | 8 streams (64 tokens each), tokens/s |")
    print("|---|---|---|")
    for tp, one, many in rows:
        print(f"| {tp} | {one:,.1f} | {many:,.1f} |")


if __name__ == "__main__":
    main()
