"""The same overload with vLLM-like backpressure settings and with trioserve's defaults (issue 5, item 5).

Runs ``frontend_cost.py`` once per setting (it starts the mock-engine server pinned to one core and the
closed-loop load generator on another, and stops both), all with the same load: by default 1024
streaming clients, a 10 ms engine step and 256 output tokens each, i.e. an engine that would emit ~100k
tokens/s, far more than one API server carries on one core. Prints one Markdown table.

    python bench/overload.py [--clients 1024] [--duration 10] [--settings vllm-like,defaults]

Settings:

- ``vllm-like``: unbounded output queue, no engine high-water mark, merge, no admission limit of any kind;
- ``defaults``: trioserve's defaults (no extra flags);
- ``no-delay-gate``: the defaults without output-delay shedding (``--max-output-delay-ms 0``: the
  defaults before it existed);
- ``max-concurrent-256``: the defaults with ``--max-concurrent-requests 256`` (the 429 path);
- ``queue-64``: the defaults with the output queue of 64 engine steps they had before (now 2).
"""

from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType

import msgspec

from loadgen_report import LoadResult

BENCH_DIR = Path(__file__).resolve().parent

SETTINGS: dict[str, list[str]] = {
    "vllm-like": [
        "--output-queue-policy=unbounded",
        "--engine-output-hwm=0",
        "--stream-policy=merge",
        "--max-concurrent-requests=0",
        "--max-pending-renders=0",
        "--max-num-seqs-waiting=0",
        "--max-loop-lag-ms=0",
        "--max-output-delay-ms=0",
    ],
    "defaults": [],
    "no-delay-gate": ["--max-output-delay-ms=0"],
    "max-concurrent-256": ["--max-concurrent-requests=256"],
    "queue-64": ["--output-queue-size=64"],
}


class _Point(msgspec.Struct):
    """One entry of ``frontend_cost.py --json``."""

    server: str
    clients: int
    error: str | None
    result: LoadResult | None
    server_peak_rss_mib: float | None = None


class _Stop(BaseException):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signum)


def run_setting(name: str, args: argparse.Namespace, out_dir: Path) -> tuple[_Point | None, str]:
    """Run ``frontend_cost.py`` for one setting; returns its point (None on error) and its stdout."""
    json_path = out_dir / f"{name}.json"
    argv = [sys.executable, str(BENCH_DIR / "frontend_cost.py"), "--clients", str(args.clients)]
    argv += ["--duration", str(args.duration), "--output-len", str(args.output_len)]
    argv += ["--step-interval-us", str(args.step_interval_us), "--json", str(json_path)]
    argv += [f"--server-arg={a}" for a in SETTINGS[name]]
    argv += args.bench_arg
    print(f"[overload] {name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        stdout, _ = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted: frontend_cost stops its own children on SIGTERM
            proc.terminate()
            proc.wait()
    if not json_path.exists():
        return None, stdout
    points = msgspec.json.decode(json_path.read_bytes(), type=list[_Point])
    return (points[0] if points else None), stdout


def _f(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def row(name: str, clients: int, p: _Point | None) -> list[str]:
    if p is None or p.result is None:
        return [name, str(clients), "error", *[""] * 9]
    r = p.result
    w = r.window_s
    rej = sum(r.rejected_window.values())
    rej_s = f"{rej} ({', '.join(f'{k}: {v}' for k, v in sorted(r.rejected_window.items()))})" if rej else "0"
    other = sum(r.failures_window.values()) + r.wrong_length + r.bad_events
    return [
        name,
        str(r.clients),
        _f(r.tokens / w),
        _f(r.ttft_p50_ms),
        _f(r.ttft_p99_ms),
        str(r.ttft_missing),
        _f(r.tokens / r.token_events if r.token_events else math.nan, 2),
        rej_s,
        str(other),
        _f(p.server_peak_rss_mib),
        _f(r.cpu_s.get("server", math.nan) / w, 2),
        str(r.requests_completed),
    ]


HEAD = [
    "setting",
    "clients",
    "tokens/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "no first token",
    "tokens/event",
    "rejected",
    "other failures",
    "API server peak RSS MiB",
    "API CPU cores",
    "requests completed",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--clients", type=int, default=1024)
    ap.add_argument("--duration", type=float, default=10.0, help="measurement window per setting, s")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-interval-us", type=int, default=10000)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    ap.add_argument("--bench-arg", action="append", default=[], help="extra argument for frontend_cost.py")
    ap.add_argument("--json", default=None, help="also write every point as JSON to this path")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    for n in names:
        if n not in SETTINGS:
            ap.error(f"unknown setting {n!r}; known: {', '.join(SETTINGS)}")

    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    points: dict[str, _Point | None] = {}
    failed: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="overload.") as tmp:
            for n in names:
                p, stdout = run_setting(n, args, Path(tmp))
                points[n] = p
                if p is None or p.result is None or p.error:
                    failed.append(f"- {n}: {p.error if p is not None and p.error else 'no result'}\n{stdout}")
    except (KeyboardInterrupt, _Stop):
        print("[overload] interrupted", file=sys.stderr)
        return 130

    expected = args.clients * 1e6 / args.step_interval_us
    print()
    print(
        f"{args.clients} closed-loop streaming clients, {args.output_len} output tokens each (ignore_eos), "
        f"mock engine step {args.step_interval_us} µs (the engine would emit ~{expected:,.0f} tokens/s), "
        f"{args.duration:g} s window per setting."
    )
    print()
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    for n in names:
        print("| " + " | ".join(row(n, args.clients, points.get(n))) + " |")
    print()
    for n in names:
        print(f"- {n}: {' '.join(SETTINGS[n]) or '(no extra flags)'}")
        p = points.get(n)
        if p is not None and p.result is not None:
            for body in p.result.rejected_samples[:4]:
                print(f"  - refused with {body}")
    if failed:
        print()
        print("\n".join(failed))
    if args.json:
        payload = {n: points.get(n) for n in names}
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(payload)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
