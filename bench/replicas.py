"""Replicas (issue 14, item 8; docs/replicas.md): a slowed replica with outlier ejection on and off,
and least-outstanding-bytes against vLLM's DP score on mixed prompt sizes. One run, side by side.

**Slowed replica.** ``serve --engine mock -dp 2 --api-server-count 1 --request-timeout-ms T``, every
request streamed by ``--clients`` closed-loop clients for ``--seconds``. Replica 1 is slowed by a duty
cycle of SIGSTOP / SIGCONT on its engine core (``--stop-ms`` stopped, ``--run-ms`` running: with the
defaults it runs a fifth of the time, and each stop outlasts the deadline), or hung (stopped for the
whole row). Five rows: both replicas healthy (the reference), then slowed and hung, each with ejection
off (``--consecutive-timeouts 0``: backoff only) and on (the default 3). Per row: answered
requests/s, 504s, TTFT p50 / p99 of the answered ones, and each replica's share of the engine
requests (``GET /v1/replicas``' ``requests_total``).

**Mixed prompt sizes.** ``serve --engine reference -dp 2 --step-time-us S --max-num-batched-tokens B``
(the reference executor: a fixed time per step, prompts prefilled in chunks of at most B tokens, so a
long prompt costs steps), the same seeded sequence of prompts (``--long-share`` of them
``--long-len`` tokens, the rest ``--short-len``), by ``--clients`` closed-loop streaming clients, once
per policy: ``dplb`` and ``least-outstanding-bytes``. Per row: requests/s, TTFT p50 / p99, each replica's
share.

    .venv/bin/python bench/replicas.py            # about 4 minutes on 2 cores

Prints the load average before and after: rerun when the machine is not quiet. Every process it
starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from frontend_cost import Proc, descendants, free_port, managed, spawn, wait_healthy
from scale_out import as_proc, find_roles, loadavg


@dataclass
class Row:
    name: str
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    share: list[int] = field(default_factory=list)
    notes: str = ""

    def quantile(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def request(port: int, body: dict[str, object]) -> tuple[int, float]:
    """(status, TTFT in seconds: 0 when not answered) of one streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.perf_counter()
    first = 0.0
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            return response.status, 0.0
        failed = False
        for raw in response:
            line = raw.strip()
            if line.startswith(b"data: {"):
                if b'"error"' in line:
                    failed = True
                elif not first:
                    first = time.perf_counter()
        if failed:
            return 504, 0.0  # the deadline ended it after it had started streaming
        return 200, first - start
    finally:
        conn.close()


def closed_loop(port: int, clients: int, bodies: Iterator[dict[str, object]], until: float, row: Row) -> None:
    """``clients`` threads, each sending the next body as its last one ends, until ``bodies`` runs
    out or ``until`` (perf_counter) passes."""
    lock = threading.Lock()

    def client() -> None:
        while time.perf_counter() < until:
            with lock:
                body = next(bodies, None)
            if body is None:
                return
            status, ttft = request(port, body)
            with lock:
                row.statuses[status] = row.statuses.get(status, 0) + 1
                if status == 200:
                    row.ttfts.append(ttft)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row.seconds = time.perf_counter() - start


def replicas_sent(port: int) -> list[int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v1/replicas")
        data = json.loads(conn.getresponse().read())["data"]
    finally:
        conn.close()
    return [int(entry["requests_total"]) for entry in data]


def serve(name: str, flags: list[str], logs: Path, procs: list[Proc]) -> tuple[Proc, int, dict[str, int]]:
    port = free_port()
    argv = [
        sys.executable, "-m", "trioserve", "serve", "--host", "127.0.0.1", "--port", str(port),
        "-dp", "2", "--api-server-count", "1", "--shutdown-timeout", "2", *flags,
    ]  # fmt: skip
    server = spawn(name, argv, None, logs)
    procs.append(server)
    wait_healthy(server, port, timeout=120)
    roles = find_roles(server.pid, 5)
    return server, port, roles


@contextlib.contextmanager
def duty_cycle(pid: int | None, stop_s: float, run_s: float) -> Iterator[None]:
    """Keep ``pid`` stopped ``stop_s`` of every ``stop_s + run_s`` while the block runs; SIGCONT
    however it ends (nothing when ``pid`` is None)."""
    done = threading.Event()

    def cycle() -> None:
        assert pid is not None
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(stop_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(run_s)

    thread = threading.Thread(target=cycle) if pid is not None else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def slowed(args: argparse.Namespace, logs: Path) -> list[Row]:
    rows = []
    slow = (args.stop_ms / 1000, args.run_ms / 1000)
    hang = (3600.0, 0.0)
    cases: list[tuple[str, tuple[float, float] | None, str]] = [
        ("both healthy", None, "3"),
        ("slowed, ejection off", slow, "0"),
        ("slowed, ejection on", slow, "3"),
        ("hung, ejection off", hang, "0"),
        ("hung, ejection on", hang, "3"),
    ]
    body = {"model": "trioserve-mock", "prompt": "hi", "max_tokens": args.max_tokens, "stream": True}
    for name, cycle, consecutive in cases:
        with managed([]) as procs:
            flags = [
                "--engine", "mock", "--step-interval-us", str(args.step_us),
                "--request-timeout-ms", str(args.timeout_ms), "--consecutive-timeouts", consecutive,
            ]  # fmt: skip
            server, port, roles = serve(name.replace(" ", "_").replace(",", ""), flags, logs, procs)
            procs[:0] = [as_proc(f"child-{c}", c) for c in descendants(server.pid)]
            closed_loop(port, 4, iter([body] * 8), time.perf_counter() + 30, Row("warm"))
            before = replicas_sent(port)
            row = Row(name)
            target = roles.get("EngineCore_DP1") if cycle else None
            with duty_cycle(target, *(cycle or (0.0, 0.0))):
                closed_loop(
                    port, args.clients, iter(lambda: body, None), time.perf_counter() + args.seconds, row
                )
            row.share = [a - b for a, b in zip(replicas_sent(port), before, strict=True)]
            log = server.log_path.read_text(errors="replace") if server.log_path else ""
            withheld = collections.Counter(
                re.findall(r"replica_ejection_withheld replica=\d+ reason=(\w+)", log)
            )
            row.notes = f"{log.count('replica_ejected')} ejections" + "".join(
                f", {n} withheld ({reason})" for reason, n in sorted(withheld.items())
            )
            rows.append(row)
            print(f"[bench] {name}: done", flush=True)
            server.signal(signal.SIGTERM)
            server.stop(grace=20.0)
    return rows


def mixed(args: argparse.Namespace, logs: Path) -> list[Row]:
    rng = random.Random(args.seed)
    prompts = [
        [
            rng.randrange(10, 30000)
            for _ in range(args.long_len if rng.random() < args.long_share else args.short_len)
        ]
        for _ in range(args.requests)
    ]
    rows = []
    for policy in ("dplb", "least-outstanding-bytes"):
        with managed([]) as procs:
            flags = [
                "--engine", "reference", "--step-time-us", str(args.ref_step_us), "--dispatch", policy,
                "--max-num-batched-tokens", str(args.batched_tokens), "--max-model-len", "8192",
            ]  # fmt: skip
            server, port, _ = serve(f"mixed-{policy}", flags, logs, procs)
            procs[:0] = [as_proc(f"child-{c}", c) for c in descendants(server.pid)]
            bodies = (
                {
                    "model": "trioserve-reference",
                    "prompt": p,
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "stream": True,
                }
                for p in prompts
            )
            before = replicas_sent(port)
            row = Row(policy)
            closed_loop(port, args.clients, bodies, time.perf_counter() + 600, row)
            row.share = [a - b for a, b in zip(replicas_sent(port), before, strict=True)]
            rows.append(row)
            print(f"[bench] {policy}: done", flush=True)
            server.signal(signal.SIGTERM)
            server.stop(grace=20.0)
    return rows


def table(rows: list[Row], title: str) -> str:
    out = [
        f"| {title} | answered/s | answered | 504 | other | TTFT p50 ms | TTFT p99 ms "
        "| share r0 / r1 | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r.statuses.get(200, 0)
        late = r.statuses.get(504, 0)
        other = sum(v for k, v in r.statuses.items() if k not in (200, 504))
        total = sum(r.share) or 1
        share = " / ".join(f"{100 * s / total:.0f} %" for s in r.share)
        out.append(
            f"| {r.name} | {ok / r.seconds:.1f} | {ok} | {late} | {other} | {1000 * r.quantile(0.5):.0f} "
            f"| {1000 * r.quantile(0.99):.0f} | {share} | {r.notes} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0, help="slowed-replica rows: run length")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--step-us", type=int, default=5000, help="mock step clock")
    p.add_argument("--timeout-ms", type=int, default=300, help="--request-timeout-ms")
    p.add_argument("--stop-ms", type=int, default=400)
    p.add_argument("--run-ms", type=int, default=100)
    p.add_argument("--requests", type=int, default=400, help="mixed-size rows: requests")
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--long-len", type=int, default=3000)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--ref-step-us", type=int, default=2000)
    p.add_argument("--batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["slowed", "mixed"], default=None)
    args = p.parse_args(argv)
    print(f"load average before: {loadavg()}  (cores: {os.cpu_count()})", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        logs = Path(tmp)
        out = []
        if args.only in (None, "slowed"):
            rows = slowed(args, logs)
            out.append(
                f"Slowed replica: mock engine, {args.step_us} us steps, {args.clients} clients, "
                f"{args.seconds:g} s per row, {args.max_tokens} tokens, --request-timeout-ms "
                f"{args.timeout_ms}; replica 1 stopped {args.stop_ms} ms of every "
                f"{args.stop_ms + args.run_ms} ms (slowed) or the whole row (hung)\n\n" + table(rows, "case")
            )
        if args.only in (None, "mixed"):
            rows = mixed(args, logs)
            out.append(
                f"Mixed prompt sizes: reference engine, {args.ref_step_us} us steps, "
                f"{args.batched_tokens} tokens per step, {args.requests} requests "
                f"({100 * args.long_share:.0f} % of {args.long_len} tokens, the rest {args.short_len}), "
                f"16 output tokens, {args.clients} clients\n\n" + table(rows, "policy")
            )
    print("\n\n".join(out))
    print(f"\nload average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
