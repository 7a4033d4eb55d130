"""Prefix-aware dispatch against vLLM's load score on a shared-prefix workload (issue 13, item 5).

One run, the same workload against ``serve --engine model -dp 2 --api-server-count 1`` once per
policy in ``--policies`` (a server each, all started together and measured one after the other, so
every policy starts with cold caches):
``--systems`` system prompts of ``--system-len`` random token ids, ``--users`` users each (a
``--user-len`` suffix of their own), in one seeded shuffled order, sent by ``--concurrency`` closed-loop
streaming clients, ``--output-len`` tokens each (EOS ignored). The model is a tiny random Llama built
here (``--hidden``, ``--layers``); each engine's KV cache is ``--blocks`` blocks of 16
(``--num-gpu-blocks-override``), sized to hold only part of the system prompts, as a real deployment's
cache holds only part of its tenants' prefixes: spreading every prompt over every engine then costs
evictions, and sending each prompt to the engine that holds it keeps the aggregate cache.

Per policy: prefix-cache hit rate = the engines' ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` over the run (tokens, from ``/metrics``), and TTFT p50 / p90 / mean
over the requests. The machine's load (``/proc/loadavg``) is printed before and after.

    .venv/bin/python bench/prefix_dispatch.py                 # prefix and dplb, ~2 minutes

Every process it starts is stopped by PID (SIGTERM, then SIGKILL): the server, and any of its
descendants still alive after it (none, when the supervisor shuts down cleanly).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from frontend_cost import Proc, descendants, free_port, managed, spawn, wait_healthy
from loadgen_report import proc_stat_fields


@dataclass
class Result:
    policy: str
    requests: int
    seconds: float
    queries: float
    hits: float
    ttfts: list[float]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def ttft(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def build_model(folder: Path, hidden: int, layers: int, max_len: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trioserve.frontend.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_len,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.hf_tokenizer.save_pretrained(folder)


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(1000, 100_000) for _ in range(args.system_len)] for _ in range(args.systems)]
    prompts = [
        [*system, *(rng.randrange(1000, 100_000) for _ in range(args.user_len))]
        for system in systems
        for _ in range(args.users)
    ]
    rng.shuffle(prompts)
    return prompts


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def one_request(port: int, prompt: list[int], output_len: int) -> float:
    """TTFT of one streamed completion (seconds)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    first = 0.0
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not first and line.startswith(b"data: {"):
                first = time.perf_counter()
    finally:
        conn.close()
    return first - start


def drive(port: int, prompts: list[list[int]], concurrency: int, output_len: int) -> list[float]:
    """Closed loop: ``concurrency`` clients take the next prompt in order as each finishes."""
    ttfts: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(prompts)

    def client() -> None:
        while True:
            with lock:
                prompt = next(todo, None)
            if prompt is None or errors:
                return
            try:
                ttft = one_request(port, prompt, output_len)
            except BaseException as exc:  # reported after the others stop
                errors.append(exc)
                return
            with lock:
                ttfts.append(ttft)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ttfts


def start_ticks(pid: int) -> int:
    fields = proc_stat_fields(pid)
    return int(fields[19]) if fields is not None else -1


def start_server(
    args: argparse.Namespace, policy: str, model: Path, logs: Path, procs: list[Proc]
) -> tuple[Proc, int]:
    port = free_port()
    argv = [
        sys.executable, "-m", "trioserve", "serve", "--engine", "model", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "-dp", "2", "--api-server-count", "1", "--dispatch", policy,
        "--num-gpu-blocks-override", str(args.blocks), "--max-num-seqs", str(args.concurrency),
        "--shutdown-timeout", "2",
    ]  # fmt: skip
    server = spawn(f"serve-{policy}", argv, None, logs)
    procs.append(server)
    return server, port


def measure(args: argparse.Namespace, policy: str, port: int, prompts: list[list[int]]) -> Result:
    # Warm-up on prompts outside the workload (token ids below 1000), then the run.
    warm = random.Random(1)
    drive(port, [[warm.randrange(10, 999) for _ in range(64)] for _ in range(4)], 2, 2)
    before = metrics(port)
    t0 = time.perf_counter()
    ttfts = drive(port, prompts, args.concurrency, args.output_len)
    seconds = time.perf_counter() - t0
    time.sleep(1.2)  # the engines' stats ride on their next message (a heartbeat at the latest)
    after = metrics(port)
    q, h = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
    return Result(policy, len(prompts), seconds, after[q] - before[q], after[h] - before[h], ttfts)


def run_all(args: argparse.Namespace, model: Path, prompts: list[list[int]], logs: Path) -> list[Result]:
    """Starts one server per policy at once (start-up is most of a run's time), then measures them one
    at a time (the idle ones only send heartbeats), then stops them all."""
    policies = args.policies.split(",")
    results: list[Result] = []
    with managed([]) as procs:
        servers = [start_server(args, policy, model, logs, procs) for policy in policies]
        for server, port in servers:
            wait_healthy(server, port, timeout=240)
        # Their descendants, by PID and start time: stopped after them in case one is left behind.
        procs[:0] = [
            Proc(f"child-{c}", c, start_ticks(c)) for server, _ in servers for c in descendants(server.pid)
        ]
        for policy, (_, port) in zip(policies, servers, strict=True):
            results.append(measure(args, policy, port, prompts))
            print(f"[bench] {policy}: done in {results[-1].seconds:.1f} s", flush=True)
        # Each supervisor drains its API server, then the engines and their workers: on a busy
        # 2-core machine that takes longer than ``managed``'s default grace.
        for server, _ in servers:
            server.signal(signal.SIGTERM)
        for server, _ in servers:
            server.stop(grace=30.0)
    return results


def table(results: list[Result]) -> str:
    rows = [
        "| policy | requests | run s | prefix-cache hit rate | hit tokens "
        "| TTFT p50 ms | TTFT p90 ms | TTFT mean ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.policy} | {r.requests} | {r.seconds:.1f} | {100 * r.hit_rate:.1f} % "
            f"| {r.hits:.0f} / {r.queries:.0f} | {1000 * r.ttft(0.5):.0f} | {1000 * r.ttft(0.9):.0f} "
            f"| {1000 * statistics.fmean(r.ttfts):.0f} |"
        )
    return "\n".join(rows)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="prefix,dplb")
    p.add_argument("--systems", type=int, default=6)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--users", type=int, default=8, help="requests per system prompt")
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--blocks", type=int, default=280, help="KV blocks of 16 per engine")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts = workload(args)
    print(f"[bench] load average before: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="prefix-dispatch-") as tmp:
        model = Path(tmp) / "model"
        build_model(model, args.hidden, args.layers, max_len=max(2048, args.system_len + args.user_len + 64))
        results = run_all(args, model, prompts, Path(tmp))
    print(f"[bench] load average after: {loadavg()}")
    print(
        f"{args.systems} system prompts x {args.users} users, "
        f"{args.system_len}+{args.user_len} prompt tokens, "
        f"{args.output_len} output tokens, {args.concurrency} clients, -dp 2, {args.blocks} KV blocks of 16 "
        f"per engine, tiny Llama hidden {args.hidden} x {args.layers} layers"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
