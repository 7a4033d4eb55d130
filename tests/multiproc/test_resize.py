"""Live resizing with real processes (docs/replicas.md, launch/resize.py): two API servers, a tree
sized for two mock replicas and started with one. A SIGHUP after the config file says 2 starts
replica 1, which takes requests once ready; one after it says 1 again retires replica 1 while
streams run there: they all finish (no admitted request is lost), the inventory says ``draining``
meanwhile, and the engine exits by itself once drained. A reload asking for more than the tree was
sized for is refused and changes nothing; growing again brings rank 1 back."""

from __future__ import annotations

import collections
import json
import os
import signal
from pathlib import Path

import trio

from ._support import RawHttp, chat_body, post
from .test_replicas import _complete, _inventory
from .test_scale_out import TIMEOUT, supervised, wait_for, wait_ready_lines, wait_titles


def _titles(engines: int) -> collections.Counter[str]:
    titles = ["Supervisor", "APIServer_0", "APIServer_1", "DPCoordinator"]
    titles += [f"EngineCore_DP{d}" for d in range(engines)]
    return collections.Counter(f"trioserve::{t}" for t in titles)


async def _inventories(port: int) -> dict[int, dict[str, object]]:
    """Each API server's inventory (connections land on either: ask until both answered)."""
    seen: dict[int, dict[str, object]] = {}
    for _ in range(200):
        inventory = await _inventory(port)
        seen[int(str(inventory["api_server"]))] = inventory
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only API servers {sorted(seen)} answered")


def _data(inventory: dict[str, object]) -> list[dict[str, object]]:
    data = inventory["data"]
    assert isinstance(data, list)
    return data


def _states(inventory: dict[str, object]) -> dict[int, str]:
    return {int(str(entry["index"])): str(entry["state"]) for entry in _data(inventory)}


async def _stream(port: int, max_tokens: int) -> int:
    """One streamed chat completion read to its end: the number of content chunks it carried."""
    async with await RawHttp.connect("127.0.0.1", port) as conn:
        await conn.send(post("/v1/chat/completions", chat_body(max_tokens, stream=True)))
        head = await conn.read_head()
        assert head.status == 200
        body = b""
        while chunk := await conn.read_chunk():
            body += chunk
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert not any("error" in c for c in chunks), chunks
    return sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))


async def test_grow_then_retire_a_replica_while_it_streams(tmp_path: Path) -> None:
    config = tmp_path / "replicas.yaml"
    config.write_text("data_parallel_size: 1\n")
    flags = ("--config", str(config), "--max-data-parallel-size", "2", "--api-server-count", "2")
    with supervised(tmp_path, "resize", *flags, "--dispatch", "round-robin") as server:
        wait_titles(server, _titles(1))
        wait_ready_lines(server, 2)
        supervisor = server.proc.pid
        with trio.fail_after(TIMEOUT):
            for inventory in (await _inventories(server.port)).values():
                assert inventory["desired"] == 1 and inventory["capacity"] == 2, inventory
                assert _states(inventory) == {0: "ready"}, inventory

            # Grow: replica 1 starts, and both API servers send to it once it is ready.
            config.write_text("data_parallel_size: 2\n")
            os.kill(supervisor, signal.SIGHUP)
            wait_titles(server, _titles(2))
            wait_for(server, lambda: server.log().count("engine 1 ready") >= 3, "replica 1 joined all")
            for inventory in (await _inventories(server.port)).values():
                assert inventory["desired"] == 2 and inventory["ready"] == 2, inventory
            for _ in range(8):
                assert await _complete(server.port) == 200
            for inventory in (await _inventories(server.port)).values():
                sent = [int(str(entry["requests_total"])) for entry in _data(inventory)]
                # Round-robin: an API server that took two requests since sent one to each.
                assert sum(sent) < 2 or min(sent) > 0, inventory

            # Refused: more than the tree was sized for. Nothing changes.
            config.write_text("data_parallel_size: 3\n")
            os.kill(supervisor, signal.SIGHUP)
            wait_for(server, lambda: "refused: data_parallel_size 3" in server.log(), "refusal")
            assert (await _inventory(server.port))["desired"] == 2

            # Shrink while long streams run on both replicas: every one of them ends whole.
            tokens = 150  # 1.5 s at the mock's 10 ms step
            results: list[int] = []

            async def stream() -> None:
                results.append(await _stream(server.port, tokens))

            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(stream)
                await trio.sleep(0.5)  # admitted and streaming
                config.write_text("data_parallel_size: 1\n")
                os.kill(supervisor, signal.SIGHUP)
                draining = False
                for _ in range(100):
                    # Whichever API server answers: while the streams hold one of them, accept
                    # balancing hands new connections to the other, so asking for both can starve.
                    if _states(await _inventory(server.port)).get(1) == "draining":
                        draining = True
                        break
                    await trio.sleep(0.02)
                assert draining, "replica 1 was never seen draining"
                for _ in range(4):  # new requests go to replica 0 meanwhile
                    assert await _complete(server.port) == 200
            assert results == [tokens] * 6, results
            wait_for(server, lambda: "replica 1 retired" in server.log(), "retired")
            wait_titles(server, _titles(1))
            assert "engine core 1 retired: every client is done with it" in server.log()
            assert "did not drain" not in server.log()
            for inventory in (await _inventories(server.port)).values():
                assert inventory["desired"] == 1 and _states(inventory) == {0: "ready"}, inventory
            for _ in range(4):
                assert await _complete(server.port) == 200

            # Grow again: rank 1 comes back as a new process.
            config.write_text("data_parallel_size: 2\n")
            os.kill(supervisor, signal.SIGHUP)
            wait_titles(server, _titles(2))
            wait_for(server, lambda: server.log().count("engine 1 ready") >= 6, "replica 1 joined again")
            for inventory in (await _inventories(server.port)).values():
                assert _states(inventory) == {0: "ready", 1: "ready"}, inventory
