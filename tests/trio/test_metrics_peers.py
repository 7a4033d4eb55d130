"""The metrics gather over real ipc sockets (frontend/metrics_peers.py), on the real clock (ZMQ's I/O
thread does not move a MockClock): two peers without an ApiServer, each with its own Metrics."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import trio
import zmq

from trioserve.frontend.metrics_peers import Families, MetricsPeers, metrics_address
from trioserve.metrics import Metrics


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tsm", dir="/tmp")  # ipc paths must be short (sun_path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.term()


def peer(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str, index: int, *, tokens: int, in_flight: int
) -> MetricsPeers:
    m = Metrics("tiny", max_model_len=512)
    m.generation_tokens = tokens
    m.ttft.observe(0.01 * (index + 1))

    def families() -> Families:
        return Families(
            {
                "vllm:num_requests_running": ("Running.", index),
                "trioserve:requests_in_flight": ("In flight.", in_flight),
            },
            {"trioserve:renderer_jobs_total": ("Jobs.", 10 * (index + 1))},
            {},
            0.1 * index,
        )

    return MetricsPeers(ctx, m, families, ipc_dir=ipc_dir, index=index, count=2, timeout=0.5)


def value(text: str, name: str, labels: str = "") -> float:
    found = re.findall(re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\} (\S+)", text)
    assert len(found) == 1, f"{name} {labels}: {found}"
    return float(found[0])


async def test_a_scrape_on_one_shows_the_sum_of_both_and_each_servers_lines(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    a = peer(ctx, ipc_dir, 0, tokens=5, in_flight=2)
    b = peer(ctx, ipc_dir, 1, tokens=7, in_flight=9)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            for scraper in (a, b):
                text = await scraper.scrape()
                assert value(text, "vllm:generation_tokens_total") == 12
                assert value(text, "vllm:time_to_first_token_seconds_count") == 2
                assert value(text, "vllm:num_requests_running") == 0  # a's view is the fresher
                assert value(text, "trioserve:requests_in_flight", 'api_server="0"') == 2
                assert value(text, "trioserve:requests_in_flight", 'api_server="1"') == 9
                assert value(text, "trioserve:renderer_jobs_total", 'api_server="1"') == 20
                assert value(text, "trioserve:metrics_peers_missing") == 0
            # Two scrapes at once share one gather (one task per socket).
            texts: list[str] = []

            async def scrape() -> None:
                texts.append(await a.scrape())

            async with trio.open_nursery() as both:
                both.start_soon(scrape)
                both.start_soon(scrape)
            assert all(value(t, "vllm:generation_tokens_total") == 12 for t in texts)
            nursery.cancel_scope.cancel()


async def test_a_peer_gone_counts_with_its_file_and_its_successor_continues(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    a = peer(ctx, ipc_dir, 0, tokens=5, in_flight=2)
    b = peer(ctx, ipc_dir, 1, tokens=7, in_flight=9)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            with trio.CancelScope() as b_scope:
                async with trio.open_nursery() as inner:
                    await inner.start(b.serve)
                    assert value(await a.scrape(), "vllm:generation_tokens_total") == 12
                    b_scope.cancel()  # b stops; the state it showed is on disk
            text = await a.scrape()
            assert value(text, "trioserve:metrics_peers_missing") == 1
            assert value(text, "trioserve:metrics_peer_up", 'api_server="1"') == 0
            assert value(text, "vllm:generation_tokens_total") == 12  # b's from its file: no drop
            assert value(text, "trioserve:renderer_jobs_total", 'api_server="1"') == 20
            assert 'trioserve:requests_in_flight{model_name="tiny",api_server="1"}' not in text

            # The supervisor starts index 1 again: it continues from b's file.
            b2 = peer(ctx, ipc_dir, 1, tokens=1, in_flight=0)
            assert b2.restored is not None
            await nursery.start(b2.serve)
            for _ in range(50):  # ZMQ reconnects to the new ROUTER on its own (100 ms interval)
                text = await a.scrape()
                if value(text, "trioserve:metrics_peers_missing") == 0:
                    break
                await trio.sleep(0.05)
            assert value(text, "trioserve:metrics_peers_missing") == 0
            assert value(text, "vllm:generation_tokens_total") == 5 + 7 + 1
            assert value(text, "trioserve:renderer_jobs_total", 'api_server="1"') == 20 + 20
            assert value(text, "trioserve:requests_in_flight", 'api_server="1"') == 0
            nursery.cancel_scope.cancel()


async def test_a_peer_that_does_not_answer_costs_the_timeout_and_its_file_is_used(
    ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    a = peer(ctx, ipc_dir, 0, tokens=5, in_flight=2)
    b = peer(ctx, ipc_dir, 1, tokens=7, in_flight=9)
    b._write(b.state())  # what b last wrote before its loop got stuck
    a.timeout = 0.2
    stuck = ctx.socket(zmq.ROUTER)  # bound, accepting, never answering
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.bind(metrics_address(ipc_dir, 1))
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(a.serve)
                start = trio.current_time()
                text = await a.scrape()
                assert trio.current_time() - start >= 0.2  # it waited for b, then gave up
                assert value(text, "trioserve:metrics_peers_missing") == 1
                assert value(text, "vllm:generation_tokens_total") == 12
                assert 'trioserve:requests_in_flight{model_name="tiny",api_server="1"}' not in text
                nursery.cancel_scope.cancel()
    finally:
        stuck.close(linger=0)
