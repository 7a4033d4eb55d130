"""Live resizing under load (issue 14, item 6; docs/replicas.md "Resizing a running server").

``serve --engine mock --step-interval-us S --max-num-seqs Q --api-server-count 2 --config FILE
--max-data-parallel-size 2``, started with one replica; ``--clients`` closed-loop clients stream
completions of ``--max-tokens`` tokens the whole run. At ``--grow-at`` seconds the file says 2 and
the supervisor gets SIGHUP; at ``--shrink-at`` it says 1 again and gets another. A replica holds at
most Q sequences, so the replica count is what bounds throughput here.

Per phase (1 replica, growing: from the SIGHUP until every API server has the new replica ready,
2 replicas, shrinking: from the SIGHUP until replica 1 retired, 1 replica again): requests finished,
finished/s, TTFT p50 / p99, and requests that failed (status other than 200, or an error event in the
stream): a resize must fail none. The grow and drain times come from the server's log.

    .venv/bin/python bench/resize.py            # about 40 s

Prints the load average before and after: rerun when the machine is not quiet. Every process it
starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from frontend_cost import Proc, free_port, managed, spawn, wait_healthy
from replicas import request
from scale_out import loadavg


@dataclass
class Finished:
    at: float  # perf_counter when the stream ended
    ttft: float
    ok: bool


@dataclass
class Run:
    done: list[Finished] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def clients(port: int, n: int, max_tokens: int, until: float, run: Run) -> list[threading.Thread]:
    body = {"model": "trioserve-mock", "prompt": "hi", "max_tokens": max_tokens, "stream": True}

    def client() -> None:
        while time.perf_counter() < until:
            status, ttft = request(port, body)  # 200: the stream ended without an error event
            with run.lock:
                run.done.append(Finished(time.perf_counter(), ttft, status == 200))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def wait_log(log: Path, text: str, count: int, timeout: float = 60.0) -> float:
    """perf_counter when ``text`` appears ``count`` times in ``log``."""
    deadline = time.perf_counter() + timeout
    while log.read_text(errors="replace").count(text) < count:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{text!r} x{count} not in the log after {timeout:g} s")
        time.sleep(0.02)
    return time.perf_counter()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--step-us", type=int, default=5000, help="mock step clock")
    p.add_argument("--max-num-seqs", type=int, default=4, help="sequences a replica holds")
    p.add_argument("--grow-at", type=float, default=8.0)
    p.add_argument("--shrink-at", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args(argv)
    print(f"load average before: {loadavg()}  (cores: {os.cpu_count()})", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resize-") as tmp, managed([]) as procs:
        logs = Path(tmp)
        config = logs / "replicas.yaml"
        config.write_text("data_parallel_size: 1\n")
        port = free_port()
        argv_ = [
            sys.executable, "-m", "trioserve", "serve", "--engine", "mock", "--host", "127.0.0.1",
            "--port", str(port), "--step-interval-us", str(args.step_us), "--max-num-seqs",
            str(args.max_num_seqs), "--api-server-count", "2", "--config", str(config),
            "--max-data-parallel-size", "2", "--shutdown-timeout", "2",
        ]  # fmt: skip
        server: Proc = spawn("serve", argv_, None, logs)
        procs.append(server)
        wait_healthy(server, port, timeout=120)
        log = logs / "serve.log"
        wait_log(log, "API server 1 ready", 1)
        run = Run()
        start = time.perf_counter()
        threads = clients(port, args.clients, args.max_tokens, start + args.seconds, run)
        time.sleep(max(0.0, start + args.grow_at - time.perf_counter()))
        config.write_text("data_parallel_size: 2\n")
        grow = time.perf_counter()
        os.kill(server.pid, signal.SIGHUP)
        grown = wait_log(log, "engine 1 ready", 3)  # both API servers and the supervisor
        time.sleep(max(0.0, start + args.shrink_at - time.perf_counter()))
        config.write_text("data_parallel_size: 1\n")
        shrink = time.perf_counter()
        os.kill(server.pid, signal.SIGHUP)
        shrunk = wait_log(log, "replica 1 retired", 1, timeout=args.seconds)
        for t in threads:
            t.join()
        end = max(f.at for f in run.done)
        text = log.read_text(errors="replace")
        drained_whole = "did not drain" not in text and "engine core 1 retired" in text
    phases = [
        ("1 replica", start, grow),
        ("growing (SIGHUP to ready)", grow, grown),
        ("2 replicas", grown, shrink),
        ("shrinking (SIGHUP to retired)", shrink, shrunk),
        ("1 replica again", shrunk, end),
    ]
    print(
        f"\nmock engine, {args.step_us} us steps, max_num_seqs {args.max_num_seqs} per replica, 2 API "
        f"servers, {args.clients} streaming clients, {args.max_tokens} tokens each\n"
    )
    print("| phase | seconds | finished | finished/s | failed | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, a, b in phases:
        inside = [f for f in run.done if a <= f.at < b or (b == end and f.at == end)]
        ok = [f for f in inside if f.ok]
        failed = len(inside) - len(ok)
        ttfts = [f.ttft for f in ok]
        span = max(b - a, 1e-9)
        print(
            f"| {name} | {span:.1f} | {len(ok)} | {len(ok) / span:.1f} | {failed} "
            f"| {1000 * quantile(ttfts, 0.5):.0f} | {1000 * quantile(ttfts, 0.99):.0f} |"
        )
    failed_total = sum(1 for f in run.done if not f.ok)
    print(
        f"\ngrow: {grown - grow:.2f} s from SIGHUP to replica 1 ready on every API server; shrink: "
        f"{shrunk - shrink:.2f} s from SIGHUP to replica 1 retired (drained by itself: {drained_whole}); "
        f"failed requests in the whole run: {failed_total} of {len(run.done)}"
    )
    print(f"\nload average after: {loadavg()}")
    return 0 if failed_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
