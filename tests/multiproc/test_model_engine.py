"""``serve --engine model``: API server → engine core → worker process over shared memory, on a tiny
random Llama (hidden 64, 2 layers) with the Qwen3 tokenizer.

Checks the whole path against transformers' ``generate()``, the process tree, and what a client sees
when the worker dies or hangs; and that a clean shutdown (the module server's teardown) leaves no
process and no shared-memory segment.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from trioserve.frontend.text.tokenizer import Tokenizer, load_tokenizer

from ._support import (
    RawHttp,
    http_request,
    post,
    proc_children,
    proc_title,
    request_json,
    sse_chunks,
    summarize,
)
from .conftest import ServerProcess

TIMEOUT = 60


def workers_of(server: ServerProcess) -> list[int]:
    return [pid for pid in proc_children(server.engine_pid) if proc_title(pid) == "trioserve::Worker"]


def proc_gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("trioserve_")}


def segments_of(pid: int) -> set[str]:
    """The trioserve shared-memory segments ``pid`` has mapped (other tests may make their own)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    # Named "(deleted)" once unlinked (the rings' names go when the worker has attached).
    lines = [line for line in maps if "/dev/shm/trioserve_" in line]
    return {line.rsplit("/", 1)[1].removesuffix(" (deleted)") for line in lines}


def tiny_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """A tiny random model's shape (hidden 64, 2 layers, 4 query heads, 2 key/value heads) for the
    Qwen3 tokenizer: Llama's and Qwen3's configs take the same names."""
    return {
        "vocab_size": tokenizer.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**tiny_config(tokenizer))).save_pretrained(folder)
    tokenizer.hf_tokenizer.save_pretrained(folder)
    return folder


def start_model_server(model: Path, log_dir: Path, name: str, *flags: str) -> ServerProcess:
    server = ServerProcess(
        name,
        ["--engine", "model", str(model), "--kv-cache-gib", "0.05", "--shutdown-timeout", "1", *flags],
        log_dir / f"{name}.log",
    )
    server.start()
    return server


@contextmanager
def running_model_server(
    model: Path, log_dir: Path, name: str, *flags: str, timeout: float = 60.0
) -> Iterator[ServerProcess]:
    """``start_model_server``, ready; stopped at the end, which checks its shutdown left nothing."""
    server = start_model_server(model, log_dir, name, *flags)
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()
    assert not server.problems, server.problems


@pytest.fixture(scope="module")
def model_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Its teardown checks that SIGTERM leaves no process and no shared-memory segment behind."""
    server = start_model_server(tiny_model, tmp_path_factory.mktemp("logs"), "model_server")
    try:
        server.wait_ready(TIMEOUT)
        (worker,) = workers_of(server)
        created = segments_of(worker)
        assert len(created) == 2, created  # the step ring and the result ring
        assert segments_of(server.engine_pid) == created
        yield server
    finally:
        server.stop()
    assert server.proc is not None
    assert server.proc.returncode == 0
    assert not server.problems, server.problems
    assert proc_gone(worker)
    assert shm_segments() & created == set()


async def stream(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with await RawHttp.connect(server.host, server.port) as conn:
        await conn.send(post("/v1/completions", {**body, "stream": True, "return_token_ids": True}))
        response = await conn.read_response()
    assert response.status == 200, response.body
    return sse_chunks(response.body)


def generate_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
        )
    return list(out[0, len(prompt_ids) :].tolist())


async def test_greedy_streams_match_generate_and_the_tree_has_a_worker(
    model_server: ServerProcess, tiny_model: Path
) -> None:
    prompts = ["The capital of France is", "one two three four five six seven eight", "hi"]
    tokenizer = load_tokenizer(str(tiny_model))
    with trio.fail_after(TIMEOUT):
        results: dict[str, list[int]] = {}

        async def one(text: str) -> None:
            chunks = await stream(
                model_server, {"prompt": text, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            )
            results[text] = summarize(chunks).token_ids[0]

        async with trio.open_nursery() as nursery:  # concurrently: batched in the engine
            for text in prompts:
                nursery.start_soon(one, text)
    for text in prompts:
        assert results[text] == generate_greedy(tiny_model, tokenizer.encode(text), 12), text

    titles = [proc_title(pid) for pid in proc_children(model_server.engine_pid)]
    # The other child is multiprocessing's resource tracker: it unlinks the rings if the engine core
    # is killed before it can.
    assert [t for t in titles if t.startswith("trioserve::")] == ["trioserve::Worker"], titles


async def test_same_seed_same_text(model_server: ServerProcess) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 42,
        "ignore_eos": True,
    }
    with trio.fail_after(TIMEOUT):
        first = summarize(await stream(model_server, body)).token_ids[0]
        second = summarize(await stream(model_server, body)).token_ids[0]
    assert first == second
    assert len(first) == 10


async def metrics_text(server: ServerProcess) -> str:
    async with await RawHttp.connect(server.host, server.port) as conn:
        await conn.send(http_request("GET", "/metrics", None, headers=[("Connection", "close")]))
        response = await conn.read_response()
    assert response.status == 200
    return response.body.decode()


def metric_value(text: str, name: str, labels: str) -> float:
    found = re.findall(
        re.escape(f'{name}{{model_name="') + r'[^"]*",' + re.escape(labels) + r"\} (\S+)", text
    )
    assert len(found) == 1, (name, labels, found)
    return float(found[0])


async def worker_threads(server: ServerProcess) -> dict[str, Any]:
    status, inventory = await request_json(server.host, server.port, "GET", "/v1/replicas")
    assert status == 200, inventory
    (threads,) = inventory["data"][0]["threads"]  # one worker
    assert isinstance(threads, dict)
    return threads


async def test_metrics_and_the_inventory_show_each_workers_threads(
    model_server: ServerProcess, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15, item 5, through the whole tree: the module's server does not learn (mode 0); a second
    one at 2 threads learns with a shadow pass per step, and shows what it learned after a request."""
    with trio.fail_after(TIMEOUT):
        off = await worker_threads(model_server)
        text = await metrics_text(model_server)
    assert off["state"] == "off" and off["mode"] == 0 and off["configured"] >= 1 and off["ranges"] == {}
    who = 'engine="0",worker="0"'
    assert metric_value(text, "trioserve:worker_threads", who) == off["configured"]
    assert metric_value(text, "trioserve:worker_thread_learning", who + ',state="off"') == 1
    assert metric_value(text, "trioserve:worker_thread_shadow_passes_total", who) == 0

    monkeypatch.setenv("TRIOSERVE_CPU_SHADOW_EVERY", "1")  # the server's processes inherit it
    flags = ("--worker-threads", "2", "--cpu-adaptive-threads", "1")
    with running_model_server(tiny_model, tmp_path, "learning", *flags) as server:
        with trio.fail_after(TIMEOUT):
            body = {"prompt": "one two three", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            assert len(summarize(await stream(server, body)).token_ids[0]) == 16
            await stream(server, {**body, "max_tokens": 1})  # carries the last shadow's outcome
            learning = await worker_threads(server)
            text = await metrics_text(server)
    assert learning["mode"] == 1 and learning["configured"] == 2 and learning["candidates"] == [1, 2]
    assert learning["state"] in ("learning", "retired"), learning
    assert learning["shadow_passes"] > 1 and learning["shadow_thread_seconds"] > 0
    decode = learning["ranges"]["1"]  # one request decoding: steps of one token
    assert decode["steps"] >= 1 and sum(decode["verified"].values()) >= 1
    assert metric_value(text, "trioserve:worker_threads", who) == 2
    assert metric_value(text, "trioserve:worker_thread_learning", who + f',state="{learning["state"]}"') == 1
    assert metric_value(text, "trioserve:worker_thread_shadow_passes_total", who) == learning["shadow_passes"]
    assert metric_value(text, "trioserve:worker_threads_serving", who + ',range="1"') == 2


async def test_a_worker_that_dies_fails_its_requests_and_cleanup_is_complete(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_model_server(tiny_model, tmp_path_factory.mktemp("logs"), "dying_worker")
    try:
        await trio.to_thread.run_sync(server.wait_ready, TIMEOUT)
        (worker,) = workers_of(server)
        created = segments_of(worker)
        assert len(created) == 2, created
        with trio.fail_after(TIMEOUT):
            async with await RawHttp.connect(server.host, server.port) as conn:
                body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
                await conn.send(post("/v1/completions", body))
                head = await conn.read_head()
                assert head.status == 200
                await conn.read_chunk()  # the stream is running
                os.kill(worker, signal.SIGKILL)
                rest = await conn.read_body(head)
        payloads = rest.body.decode()
        assert "worker 0 died (killed by signal 9)" in payloads
        assert payloads.rstrip().endswith("data: [DONE]")
        status, health = await request_json(server.host, server.port, "GET", "/health")
        assert status == 503
        assert "worker 0 died" in health["error"]["message"]
        # The engine core reported it and exited; its rings are gone with it.
        assert await trio.to_thread.run_sync(server.wait_engine_gone, TIMEOUT)
        assert shm_segments() & created == set()
    finally:
        server.stop()


async def test_a_hung_worker_fails_the_step_after_the_timeout(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_model_server(
        tiny_model, tmp_path_factory.mktemp("logs"), "hung_worker", "--worker-step-timeout", "1"
    )
    try:
        await trio.to_thread.run_sync(server.wait_ready, TIMEOUT)
        (worker,) = workers_of(server)
        os.kill(worker, signal.SIGSTOP)
        with trio.fail_after(TIMEOUT):
            status, body = await request_json(
                server.host, server.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}
            )
        assert status == 503, body
        assert "took more than 1 s" in body["error"]["message"]
        assert await trio.to_thread.run_sync(server.wait_engine_gone, TIMEOUT)
        assert proc_gone(worker)  # the engine core killed its stopped worker on the way out
    finally:
        server.stop()
