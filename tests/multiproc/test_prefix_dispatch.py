"""``--dispatch prefix`` on the whole process tree (``-dp 2``, the model engine on a tiny random Llama):
a second request with the same long system prompt goes to the engine that served the first, so it is a
prefix-cache hit; with ``dplb`` (the control) ties rotate and it lands on the other, empty, engine."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

import pytest

from ._own_server import Server
from .test_model_engine import tiny_model  # noqa: F401  (a fixture)
from .test_scale_out import expected_titles, helpers, supervised, wait_titles

SYSTEM = list(range(1000, 1256))  # 256 tokens: 16 blocks of 16
BLOCK = 16


def metric(server: Server, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def complete(server: Server, prompt: list[int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        body = f'{{"model": "tiny", "prompt": {prompt}, "max_tokens": 2, "ignore_eos": true}}'
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()
    finally:
        conn.close()


def hits_after(server: Server, queries_before: float, want_queries: float) -> float:
    """The hit count once the engines' stats cover the queries made (they ride on the next step's or
    heartbeat's message; the wait only guards against a hang)."""
    deadline = time.monotonic() + 10
    while metric(server, "vllm:prefix_cache_queries_total") < queries_before + want_queries:
        assert time.monotonic() < deadline, "the engines' stats never arrived"
        time.sleep(0.05)
    return metric(server, "vllm:prefix_cache_hits_total")


@pytest.mark.parametrize("policy", ["prefix", pytest.param("dplb", marks=pytest.mark.long)])
def test_a_shared_system_prompt_goes_to_the_engine_that_caches_it(
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
    policy: str,
) -> None:
    flags = (
        "--engine", "model", str(tiny_model), "--served-model-name", "tiny", "--kv-cache-gib", "0.05",
        "-dp", "2", "--api-server-count", "1", "--dispatch", policy,
    )  # fmt: skip
    with supervised(tmp_path, f"prefix_{policy}", *flags) as server:
        # This tree is docs/processes.md's -dp 2 --api-server-count 1 row with the model engine: its
        # titles, and the one kind of helper process (a resource tracker per engine core).
        wait_titles(server, expected_titles(1, 2, workers=True), timeout=120)
        assert all("multiprocessing.resource_tracker" in h for h in helpers(server.proc.pid))
        first = [*SYSTEM, *range(5, 21)]
        complete(server, first)
        assert hits_after(server, 0, len(first)) == 0  # a cold cache
        queries = metric(server, "vllm:prefix_cache_queries_total")
        second = [*SYSTEM, *range(40, 56)]  # the same system prompt, another user
        complete(server, second)
        hits = hits_after(server, queries, len(second))
        if policy == "prefix":
            assert hits == len(SYSTEM)  # every system-prompt block, from the engine that served the first
        else:
            assert hits == 0  # the other engine: nothing cached there
