"""Start-up time (issue 18, item 5): from ``python -m trioserve serve`` to the first 200 on ``/health``.

For each of ``--runs`` runs, per engine (``model``: the embedded SmolLM2-135M, already converted;
``mock``: no model, the API server's own path), start ``serve`` on a free port, poll ``/health``
every 20 ms, and read when each phase ended from the server's log (its timestamps, against the
wall clock at spawn): the API server's modules and tokenizer, the worker's model load, the engine's
Ready, the API server's "ready". Then stop it by PID.

    .venv/bin/python bench/startup.py [--runs 3] [--engines model,mock]

``--model PATH`` serves another model folder (the tiny one of ``bench/peers/tiny_model.py``, whose
steps are short enough for page faults to show). ``--load N``: once healthy, N closed-loop clients
stream 64-token completions for two windows of ``--window`` seconds each, back to back (the first
starting as soon as the clients are in flight): tokens/s and TTFT p50 in the first seconds after
ready against the seconds after them, so that work left running past ready (the KV pool's pages,
``worker/kv_prefault.py``) shows where users see it.

The embedded model is converted first if it is not cached (its first run's conversion is not
counted). Prints the load average before and after: rerun when the machine is not quiet.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frontend_cost import Proc, free_port, http_get, managed, spawn
from scale_out import loadavg

PHASES = {  # column -> the log line that ends it
    "API modules + tokenizer": r"API server modules and tokenizer loaded",
    "worker imports done": r"trioserve\.worker\] worker \d+: \d+ threads",  # its first line, in _load
    "worker model loaded": r"trioserve\.worker\] loaded ",
    "engine ready": r"engine core 0 ready",
    "API ready": r"trioserve ready on",
    "KV pool resident": r"KV pool resident",
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def phase_times(log: str, spawned: float) -> dict[str, float]:
    """Seconds from ``spawned`` (wall clock) to the first log line of each phase."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, pattern in PHASES.items():
            if name not in out and re.search(pattern, line):
                out[name] = at - spawned
    return out


def window(port: int, clients: int, seconds: float) -> tuple[float, float | None]:
    """One load window right now: (tokens/s, TTFT p50 ms of the requests sent inside it, if any)."""
    loadgen = str(Path(__file__).with_name("sse_loadgen.py"))
    out = subprocess.run(
        [
            *(sys.executable, loadgen, "--port", str(port), "--quiet", "--clients", str(clients)),
            *("--warmup", "0", "--ramp", "0", "--duration", str(seconds), "--grace", "5"),
            *("--random-output-len", "64", "--random-input-len", "32"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    return result["tokens"] / result["window_s"], result["ttft_p50_ms"]


def one_start(
    engine: str, logs: Path, run: int, load: int = 0, seconds: float = 3.0, model: str | None = None
) -> tuple[float, dict[str, float], list[tuple[float, float | None]]]:
    port = free_port()
    argv = [sys.executable, "-m", "trioserve", "serve", *([model] if model else [])]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    if engine == "mock":
        argv += ["--engine", "mock"]
    with managed([]) as procs:
        spawned = time.time()
        began = time.perf_counter()
        server: Proc = spawn(f"{engine}-{run}", argv, None, logs)
        procs.append(server)
        while True:
            if not server.alive():
                raise RuntimeError(f"serve exited during start-up:\n{server.log_tail()}")
            with contextlib.suppress(OSError):
                if http_get(f"http://127.0.0.1:{port}/health", timeout=1.0)[0] == 200:
                    break
            if time.perf_counter() - began > 300:
                raise RuntimeError(f"not healthy after 300 s:\n{server.log_tail()}")
            time.sleep(0.02)
        took = time.perf_counter() - began
        windows = [window(port, load, seconds) for _ in range(2)] if load else []
        log = (logs / f"{engine}-{run}.log").read_text(errors="replace")
    return took, phase_times(log, spawned), windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engines", default="model,mock")
    p.add_argument("--load", type=int, default=0, help="clients streaming right after ready (0: none)")
    p.add_argument("--model", default=None, help="a model folder to serve (default: the embedded model)")
    p.add_argument("--window", type=float, default=3.0, help="seconds per load window")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    if "model" in engines:
        from trioserve.models.embedded_model import ensure_default_model

        ensure_default_model()  # a first run converts it; not counted
    print(f"load average before: {loadavg()}  (cores: {os.cpu_count()})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for run in range(args.runs):
            for engine in engines:
                took, phases, windows = one_start(engine, Path(tmp), run, args.load, args.window, args.model)
                rows.append((engine, run, took, phases))
                print(f"  {engine} run {run}: {took:.2f} s", flush=True)
                for i, (rate, ttft) in enumerate(windows):
                    first = "-" if ttft is None else f"{ttft:.0f} ms"
                    print(f"    window {i + 1}: {rate:,.0f} tokens/s, TTFT p50 {first}", flush=True)
    names = list(PHASES)
    print("\n| engine | run | to /health 200, s | " + " | ".join(f"{n}, s" for n in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for engine, run, took, phases in rows:
        cells = " | ".join(f"{phases[n]:.2f}" if n in phases else "-" for n in names)
        print(f"| {engine} | {run} | {took:.2f} | {cells} |")
    for engine in engines:
        times = sorted(t for e, _, t, _ in rows if e == engine)
        print(f"{engine}: median {times[len(times) // 2]:.2f} s, min {times[0]:.2f} s over {len(times)} runs")
    print(f"\nload average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
