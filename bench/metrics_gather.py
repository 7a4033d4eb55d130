"""What gathering /metrics across API servers costs (design §11, frontend/metrics_peers.py).

Nothing is added on the token path (an observation stays a bisect and two adds); the cost is at
scrape time. Prints µs per operation, for N = 2 and 4 API servers, with histograms filled as after
real traffic and the ~25 gauges and ~17 counters an ApiServer exposes:

- observe: one histogram observation (the per-token cost, unchanged);
- state: one server's ``MetricsState`` (incl. the /proc read) + msgpack encode: what a peer's answer costs it;
- write: one atomic state-file write;
- merge: decode N-1 peer states + ``render_states``: the scraped server's CPU for the merge;
- scrape: ``MetricsPeers.scrape`` end to end over real ipc sockets, N peers in this one process (so it
  includes every peer's answer, run on the same loop: an upper bound on one server's share).

Runs in a few seconds: ``.venv/bin/python bench/metrics_gather.py``.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable

import trio
import zmq

from trioserve.frontend.metrics_peers import Families, MetricsPeers
from trioserve.metrics import Metrics, MetricsState, decode_state, encode_state, state_path, write_state

GAUGES = {f"trioserve:gauge_{i}": (f"Gauge {i}.", float(i)) for i in range(22)} | {
    "vllm:num_requests_running": ("Running.", 12),
    "vllm:num_requests_waiting": ("Waiting.", 3),
    "vllm:kv_cache_usage_perc": ("KV.", 0.42),
}
COUNTERS = {f"trioserve:counter_{i}_total": (f"Counter {i}.", 1000 + i) for i in range(14)} | {
    "vllm:num_preemptions_total": ("Preemptions.", 2),
    "vllm:prefix_cache_queries_total": ("Queries.", 10_000),
    "vllm:prefix_cache_hits_total": ("Hits.", 4_000),
}
REJECTED = {"queue_full": 3, "too_long": 1, "loop_lag": 2}


def filled(seed: int) -> Metrics:
    """A Metrics after 20k tokens of traffic: every bucket of every histogram has counts."""
    rng = random.Random(seed)
    m = Metrics("model", max_model_len=8192)
    for _ in range(20_000):
        m.itl.observe(rng.expovariate(40))
        m.loop_lag.observe(rng.expovariate(500))
        m.output_delay.observe(rng.expovariate(500))
    for _ in range(1_000):
        m.ttft.observe(rng.expovariate(5))
        m.e2e.observe(rng.expovariate(0.3))
        m.queue_time.observe(rng.expovariate(10))
        m.iteration_tokens.observe(rng.randrange(1, 4096))
        m.observe_request(rng.randrange(8000), rng.randrange(2000), 1, rng.random() * 10)
    m.finished = {"length": 600, "stop": 400}
    m.generation_tokens = m.prompt_tokens = 20_000
    return m


def per_call(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """µs per call, the best of three runs of ``seconds`` each."""
    best = float("inf")
    for _ in range(3):
        n = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            for _ in range(100):
                fn()
            n += 100
        best = min(best, elapsed / n)
    return best * 1e6


def state(m: Metrics, index: int) -> MetricsState:
    return m.state(GAUGES, COUNTERS, REJECTED, index=index, engine_age=0.1 * index)


async def scrape_cost(n: int, ipc_dir: str, rounds: int = 200) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peers = []
    for i in range(n):
        peers.append(
            MetricsPeers(
                ctx,
                filled(i),
                lambda: Families(GAUGES, COUNTERS, REJECTED, 0.1),
                ipc_dir=ipc_dir,
                index=i,
                count=n,
            )
        )
    try:
        async with trio.open_nursery() as nursery:
            for p in peers:
                await nursery.start(p.serve)
            for _ in range(20):  # warm up: every connection made
                await peers[0].scrape()
            start = time.perf_counter()
            for _ in range(rounds):
                text = await peers[0].scrape()
            elapsed = time.perf_counter() - start
            assert "trioserve:metrics_peers_missing" in text and 'api_server="1"' in text
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
    return elapsed / rounds * 1e6


def main() -> None:
    m = filled(0)
    print(f"observe (per token, unchanged):         {per_call(lambda: m.itl.observe(0.03)):8.2f} µs")
    own = state(m, 0)
    size = len(encode_state(own))
    answer = per_call(lambda: encode_state(state(m, 0)))
    print(f"state + encode (a peer's answer):       {answer:8.1f} µs ({size} B)")
    tmp = tempfile.mkdtemp(prefix="tsb", dir="/tmp")
    try:
        path = state_path(tmp, 0)
        on_tmp = per_call(lambda: write_state(path, own))
        print(f"state-file write, {tmp} (worker thread): {on_tmp:8.1f} µs")
        shm = "/dev/shm/tsb_metrics.state"
        try:
            print(
                f"state-file write, tmpfs /dev/shm:       {per_call(lambda: write_state(shm, own)):8.1f} µs"
            )
        finally:
            os.unlink(shm)
        alone = per_call(lambda: m.render(GAUGES, COUNTERS, REJECTED))
        print(f"render alone, one server (today):       {alone:8.1f} µs")
        for n in (2, 4):
            payloads = [encode_state(state(filled(i), i)) for i in range(1, n)]
            up = dict.fromkeys(range(n), True)

            def merge(payloads: list[bytes] = payloads, up: dict[int, bool] = up) -> str:
                states = [state(m, 0)] + [s for p in payloads if (s := decode_state(p)) is not None]
                return m.render_states(GAUGES, COUNTERS, states, up)

            lines = merge().count("\n")
            print(f"N={n}: decode peers + merge + render:    {per_call(merge):8.1f} µs ({lines} lines)")
        for n in (2, 4):
            print(f"N={n}: scrape over ipc (all peers here): {trio.run(scrape_cost, n, tmp):8.1f} µs")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if importlib.util.find_spec("prometheus_client") is None:
        print("prometheus_client is not installed in this venv: its multiprocess mode was not measured")


if __name__ == "__main__":
    main()
