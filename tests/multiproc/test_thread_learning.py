"""Thread learning in a real worker process (issue 15, item 6): a tiny random Llama served by
``open_worker_executor`` at 2 threads with ``cpu_adaptive_threads=1`` and one shadow pass per served
step (``TRIOSERVE_CPU_SHADOW_EVERY=1``), so the learner sees counts 1 and 2 within a few dozen steps.

Whatever this host does is accepted, and printed: either every shadow pass at 1 and 2 threads
reproduced the served logits bit for bit and the worker logged a learned table, or one did not and the
worker retired learning with the drift line. Either way the greedy outputs equal those of the same
worker with learning off: the shadows changed nothing a client gets.

Beside it, on the runner in this process: a shadow pass that computes something else (its input
embeddings perturbed) is caught as drift, and the paged cache holds the served pass's keys and values
afterwards, byte for byte.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
import torch
import trio
from transformers import LlamaForCausalLM

from trioserve.config import WorkerConfig
from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.engine.worker_executor import WorkerExecutorConfig, open_worker_executor
from trioserve.protocol.messages import AddRequest, SamplingParams
from trioserve.protocol.thread_report import WorkerThreads, decode_worker_threads
from trioserve.worker.model_runner import ModelRunner
from trioserve.worker.shadow import ThreadTuner
from trioserve.worker.thread_context import ThreadContext
from trioserve.worker.thread_learner import LearnerRules, ThreadLearner

from .test_worker_logprobs import VOCAB, tiny_config

PROMPTS = {"a": [(5 + 7 * i) % VOCAB for i in range(9)], "b": [(11 + 3 * i) % VOCAB for i in range(5)]}
MAX_TOKENS = 24  # two requests decoding together: range 2 gets 10 verified shadows well within this


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-threads")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(folder)
    return folder


def generate(model: Path, adaptive: Literal[0, 1, 2]) -> tuple[dict[str, list[int]], list[WorkerThreads]]:
    """Greedy outputs of ``PROMPTS`` from a real worker at 2 threads, learning in ``adaptive`` mode,
    and the thread reports the engine core holds at the end (what its stats carry to API servers)."""
    worker = WorkerConfig(
        device="cpu", dtype="float32", kv_cache_gib=0.01, worker_threads=2, cpu_adaptive_threads=adaptive
    )
    executor_config = WorkerExecutorConfig(str(model), worker, block_size=4, num_blocks=64)
    scheduler = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_blocks=64, block_size=4
    )
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    reports: list[WorkerThreads] = []

    async def main() -> None:
        async with open_worker_executor(executor_config) as executor:
            core = SchedulerCore(
                scheduler, executor, vocab_size=VOCAB, kind="model", threads=executor.ready.threads
            )
            for rid, prompt in PROMPTS.items():
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                core.add(AddRequest(rid, prompt, params, 0.0))
            with trio.fail_after(40):
                while core.has_work:
                    assert core.schedule() is not None
                    await core.execute()
                    for outs in core.update().values():
                        for o in outs:
                            tokens[o.request_id] += o.new_token_ids
                # One more step carries the last shadow pass's outcome (it ran after its answer).
                core.add(AddRequest("last", [1], SamplingParams(max_tokens=1), 0.0))
                assert core.schedule() is not None
                await core.execute()
                core.update()
                reports.extend(decode_worker_threads(core.stats().worker_threads))

    trio.run(main)
    return tokens, reports


def test_a_real_worker_learns_or_retires_and_changes_no_answer(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRIOSERVE_CPU_SHADOW_EVERY", "1")  # the worker process inherits it
    plain, off = generate(tiny_model, 0)
    learning, report = generate(tiny_model, 1)
    log = capfd.readouterr().err
    assert all(len(t) == MAX_TOKENS for t in plain.values())
    assert learning == plain  # the shadow passes changed nothing a client gets
    assert "golden check at 2 threads passed" in log, log
    learned = re.findall(r"threads learned for range (\d+) \(.*?\): fastest (\d+); medians (.*)", log)
    retired = re.findall(r"thread learning retired: (.*)", log)
    if retired:
        assert retired[0].startswith("drift: "), retired
        outcome = f"retired: {retired[0]}"
        assert report[0].state == "retired" and report[0].reason == retired[0]
    else:
        assert learned, log  # range 2 (two decodes a step) had 10 shadowed steps at least
        assert {rng for rng, _, _ in learned} >= {"2"}
        outcome = "bit-identical at 1 and 2 threads; learned " + "; ".join(
            f"range {rng}: fastest {fastest} ({medians})" for rng, fastest, medians in learned
        )
        assert report[0].state == "learning" and report[0].reason is None
        assert {str(r): x.fastest for r, x in report[0].ranges.items() if x.fastest} == {
            rng: int(fastest) for rng, fastest, _ in learned
        }
        for rng, _, _ in learned:  # each count's median and M verified passes at least
            record = report[0].ranges[int(rng)]
            assert set(record.medians) == {1, 2} and min(record.verified.values()) >= 5
    # What the engine core holds for API servers: the worker's report as of its last shadow pass.
    assert [(r.rank, r.configured, r.mode, r.state) for r in off] == [(0, 2, 0, "off")]
    assert off[0].shadow_passes == 0 and off[0].ranges == {}
    (one,) = report
    assert (one.rank, one.configured, one.mode, one.candidates) == (0, 2, 1, [1, 2])
    assert one.shadow_passes == one.shadow_plans - one.shadow_abandoned > 0
    assert one.shadow_seconds > 0 and one.shadow_thread_seconds >= one.shadow_seconds
    with capfd.disabled():
        print(f"\nthread learning on this host: {outcome}")


class _Perturbed:
    """The model, with its input embeddings nudged while ``perturb`` is set (a count that drifts)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.perturb = False

    def __call__(self, **kw: Any) -> Any:
        if not self.perturb:
            return self.model(**kw)
        embeds = self.model.get_input_embeddings()(kw.pop("input_ids")) * 1.001
        return self.model(inputs_embeds=embeds, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _cache_bytes(runner: ModelRunner) -> list[bytes]:
    return [t.numpy().tobytes() for t in (*runner.cache.keys, *runner.cache.values)]


def _drifting(runner: ModelRunner, wrapped: _Perturbed, at: int) -> None:
    """Make ``runner``'s re-runs at ``at`` threads compute something else."""
    original = runner.reforward

    def reforward(count: int) -> tuple[float, bytes]:
        wrapped.perturb = count == at
        try:
            return original(count)
        finally:
            wrapped.perturb = False

    runner.reforward = reforward  # type: ignore[method-assign]


def _twin_runners() -> tuple[ModelRunner, ModelRunner, _Perturbed]:
    """Two 1-thread runners on the same random weights: a plain one, and one whose model can be
    perturbed (the wrapper, returned third)."""
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(tiny_config())
    model.eval()
    wrapped = _Perturbed(model)
    plain = ModelRunner(model, num_blocks=32, block_size=4, num_threads=1)
    return plain, ModelRunner(wrapped, num_blocks=32, block_size=4, num_threads=1), wrapped


def _scheduler() -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, num_blocks=32, block_size=4
    )
    scheduler = Scheduler(config)
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        assert scheduler.add_request(AddRequest(rid, prompt, params, 0.0), 0.0) is None
    return scheduler


def test_a_rerun_that_computes_otherwise_leaves_the_cache_as_served() -> None:
    """Two runners on the same weights serve the same steps (chunked prefills beside decodes, then
    decodes of two requests); one re-runs every step perturbed after serving it. The re-runs' logits
    differ from the served ones, yet the answers and the paged caches stay byte-equal at every step,
    and the golden check leaves the pool as it found it."""
    plain, shadowed, wrapped = _twin_runners()
    assert shadowed.golden(1) == shadowed.golden(1)
    assert _cache_bytes(shadowed) == _cache_bytes(plain)
    _drifting(shadowed, wrapped, at=2)
    scheduler, now, reruns = _scheduler(), 0.0, 0
    while scheduler.has_work:
        now += 1.0
        out = scheduler.schedule(now)
        expected = plain.run(out)
        assert shadowed.run(out, keep_logits=True) == expected
        if shadowed.last is not None:
            _, logits = shadowed.reforward(2)
            assert logits != shadowed.last.logits
            reruns += 1
        assert _cache_bytes(shadowed) == _cache_bytes(plain), f"step {out.step}: the caches differ"
        scheduler.update_from_output(out, expected.sampled)
    assert reruns >= 8


def test_a_drifting_count_retires_learning_and_serving_goes_on() -> None:
    """The tuner on a runner whose 2-thread re-runs drift: golden check, the warm pass and the
    1-thread shadow are exact; the first 2-thread shadow retires learning, naming the count."""
    plain, runner, wrapped = _twin_runners()
    _drifting(runner, wrapped, at=2)
    learner = ThreadLearner(LearnerRules(1, 1, candidates=(1, 2), shadow_every=1))
    tuner = ThreadTuner(runner, learner)
    assert tuner.golden() and learner.state == "warming"
    scheduler, now = _scheduler(), 0.0
    reports: list[str] = []  # the state in each report a result carried
    while scheduler.has_work:
        now += 1.0
        out = scheduler.schedule(now)
        expected = plain.run(out)
        got: list[Any] = []
        served = tuner.serve(out, got.append)
        assert got == [served] and msgspec.structs.replace(served, threads=None) == expected
        if served.threads is not None:
            reports.append(served.threads.state)
        scheduler.update_from_output(out, expected.sampled)
        learner.check_invariants()
    # The golden check's report, then one after each shadow pass (on the next step), then none.
    assert reports == ["warming", "learning", "learning", "retired"]
    assert str(learner.state) == "retired" and learner.reason is not None
    assert learner.reason.startswith("drift: a shadow pass at 2 threads"), learner.reason
    assert learner.shadow_passes == 3  # the warm pass, one at 1 thread, the drifting one
    assert tuner.report().state == "retired" and tuner.take_report() is None


def test_each_forward_states_its_count_on_its_own_thread() -> None:
    """``ThreadContext.use``: a count set on one thread stays there (another thread's set does not
    move it), a fresh thread starts from the last count set anywhere (torch's process-wide value, read
    at its first parallel region), and a count already in force is not set again (each set clears
    oneDNN's cache)."""
    context = ThreadContext()
    assert context.backend == "OpenMP"
    original = torch.get_num_threads()
    seen: dict[str, int | None] = {}
    try:
        assert context.use(1) == 1 and context.current == 1
        sets = context.sets
        assert context.use(1) == 1 and context.sets == sets  # already 1 on this thread: no call

        def other() -> None:
            seen["fresh"] = torch.get_num_threads()  # the last count set anywhere: 1
            seen["own"] = context.use(2)
            seen["current"] = context.current

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert seen == {"fresh": 1, "own": 2, "current": 2}
        assert torch.get_num_threads() == 1 and context.current == 1  # this thread kept its own

        def fresh() -> None:
            seen["second fresh"] = torch.get_num_threads()

        worker = threading.Thread(target=fresh)
        worker.start()
        worker.join()
        assert seen["second fresh"] == 2  # inherits the latest set, made on the other thread
        assert context.use(0) == 1  # 0: leave it
    finally:
        torch.set_num_threads(original)
