"""Worker thread reports from the worker to /metrics and the inventory (issue 15, item 5;
protocol/thread_report.py, engine/scheduler_core.py, frontend/thread_metrics.py)."""

from __future__ import annotations

import math
import re

import msgspec
import trio

from trioserve.engine.executor import ReferenceExecutor
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.frontend.thread_metrics import thread_families, thread_inventory
from trioserve.metrics import Metrics
from trioserve.protocol.messages import AddRequest, EngineOutputs, EngineStats, SamplingParams
from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.thread_report import (
    NO_WORKER_THREADS,
    REASON_CHARS,
    THREAD_REPORT_BYTES,
    ThreadRange,
    WorkerThreads,
    decode_worker_threads,
    encode_worker_threads,
)
from trioserve.protocol.worker_messages import StepResult, step_result_bytes
from trioserve.worker.thread_learner import LearnerRules, ThreadLearner


def learned_report() -> WorkerThreads:
    """A learner at 2 threads whose range 4 learned 1 as fastest (M = 2: the warm pass, then two
    passes per count) and range 8 is learning (one pass per count): 7 shadow passes."""
    learner = ThreadLearner(LearnerRules(1, 2, shadow_every=1, min_samples=2))
    learner.on_golden(True, 0.0)
    now = 0.0
    for tokens, seconds in [(4, {1: 1.0, 2: 2.0})] * 5 + [(8, {1: 3.0, 2: 3.0})] * 2:
        now += 1.0
        plan = learner.on_served(tokens, now)
        assert plan is not None
        learner.on_shadow(plan, seconds[plan.count], True, now)
    report = learner.report(rank=0)
    assert report.ranges[4].fastest == 1 and report.ranges[8].fastest is None
    return report


def test_the_worst_report_fits_the_room_the_result_ring_leaves() -> None:
    counts = list(range(1, 18))
    record = ThreadRange(
        tokens=(2**30 + 1, 2**31),
        status="verifying",
        fastest=16,
        serving=16,
        steps=2**40,
        medians=dict.fromkeys(counts, math.pi),
        verified=dict.fromkeys(counts, 2**40),
        served_medians=dict.fromkeys(counts, math.pi),
        transition_passes=2**40,
        learned_at=1e9 + math.pi,
        serving_since=1e9 + math.pi,
    )
    worst = WorkerThreads(
        rank=2**16,
        configured=16,
        mode=2,
        state="waiting_golden",
        reason="\U0001f600" * REASON_CHARS,  # four bytes a character
        retired_at=1e9 + math.pi,
        candidates=counts,
        shadow_every=2**40,
        min_samples=2**40,
        transition_window=2**40,
        window=2**40,
        served_steps=2**60,
        shadow_plans=2**60,
        shadow_passes=2**60,
        shadow_abandoned=2**60,
        shadow_seconds=math.pi,
        shadow_thread_seconds=math.pi,
        ranges={2**i: record for i in range(32)},
        set_num_threads_calls=2**60,
        parallel_backend="OpenMP" * 4,
    )
    assert len(msgspec.msgpack.encode(worst)) <= THREAD_REPORT_BYTES
    # ... and that room is in the slot: one request's result plus the report.
    assert step_result_bytes(1, 1) >= len(msgspec.msgpack.encode(StepResult(1, {"r": [1]}, threads=worst)))


def test_a_learners_reason_is_cut_to_the_bound() -> None:
    learner = ThreadLearner(LearnerRules(1, 2))
    learner.on_golden(True, 0.0)
    learner.retire("x" * (3 * REASON_CHARS), 1.0)
    report = learner.report()
    assert report.state == "retired" and report.reason == "x" * REASON_CHARS


def test_reports_ride_in_engine_stats_and_an_older_decoder_skips_them() -> None:
    report = learned_report()
    stats = EngineStats(1, 2, worker_threads=encode_worker_threads([report]))
    frame = msgspec.msgpack.encode(EngineOutputs(3, 7, 0.0, [], stats))
    got = msgspec.msgpack.decode(frame, type=EngineOutputs).stats
    assert decode_worker_threads(got.worker_threads) == [report]
    assert decode_worker_threads(EngineStats(0, 0).worker_threads) == []  # the default: none
    assert decode_worker_threads(b"\xc1") == []  # garbage reads as none

    class OldStats(msgspec.Struct, array_like=True):  # a decoder from before the field
        num_waiting: int
        num_running: int

    old = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=OldStats)
    assert (old.num_waiting, old.num_running) == (1, 2)


class _Answers:
    """An executor that answers each step with the next prepared ``StepResult`` (reference tokens)."""

    def __init__(self, threads: list[WorkerThreads | None]) -> None:
        self.reference = ReferenceExecutor(64, 4, 100)
        self.threads = threads
        self.failure = None
        self.on_failure = lambda: None

    async def execute(self, step: SchedulerOutput) -> StepResult:
        sampled = self.reference.execute_now(step)
        return StepResult(step.step, sampled, threads=self.threads.pop(0))


def test_the_engine_core_keeps_each_workers_latest_report_for_every_rank() -> None:
    first = WorkerThreads(rank=0, configured=2, mode=1, state="warming")
    later = msgspec.structs.replace(first, state="learning", shadow_passes=1)
    executor = _Answers([None, later, None])
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_blocks=64, block_size=4
    )
    core = SchedulerCore(config, executor, vocab_size=100, kind="model", threads=first, ranks=2)

    def ranks_and_states() -> list[tuple[int, str]]:
        return [(r.rank, r.state) for r in decode_worker_threads(core.stats().worker_threads)]

    assert ranks_and_states() == [(0, "warming"), (1, "warming")]  # from WorkerReady
    core.add(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), 0.0))
    seen = []
    while core.has_work:
        assert core.schedule() is not None
        trio.run(core.execute)
        core.update()
        seen.append(ranks_and_states())
    # None keeps the last report; a new one replaces it, for both ranks.
    assert seen == [[(0, "warming"), (1, "warming")]] + [[(0, "learning"), (1, "learning")]] * 2
    reference = SchedulerCore(config, ReferenceExecutor(64, 4, 100), vocab_size=100)
    assert reference.stats().worker_threads == NO_WORKER_THREADS


def test_metrics_show_each_workers_count_state_table_and_shadow_cost() -> None:
    report = learned_report()
    off = WorkerThreads(rank=0, configured=4, reason="only CPU workers learn (this one is on cuda:0)")
    stats = {
        0: EngineStats(0, 0, worker_threads=encode_worker_threads([report])),
        1: EngineStats(0, 0, worker_threads=encode_worker_threads([off])),
        2: EngineStats(0, 0),  # no workers (a mock engine): no lines
    }
    m = Metrics("tiny", max_model_len=64)
    text = m.render({}, {}, {}, thread_families(stats))

    def value(name: str, labels: str) -> float:
        found = re.findall(re.escape(f'{name}{{model_name="tiny",{labels}}}') + r" (\S+)\n", text)
        assert len(found) == 1, (name, labels, text)
        return float(found[0])

    assert value("trioserve:worker_threads", 'engine="0",worker="0"') == 2
    assert value("trioserve:worker_threads", 'engine="1",worker="0"') == 4
    assert "# TYPE trioserve:worker_threads gauge" in text and 'engine="2"' not in text
    assert value("trioserve:worker_thread_learning", 'engine="0",worker="0",state="learning"') == 1
    assert value("trioserve:worker_thread_learning", 'engine="0",worker="0",state="retired"') == 0
    assert value("trioserve:worker_thread_learning", 'engine="1",worker="0",state="off"') == 1
    assert value("trioserve:worker_threads_learned", 'engine="0",worker="0",range="4"') == 1
    assert 'worker_threads_learned{model_name="tiny",engine="0",worker="0",range="8"}' not in text
    assert value("trioserve:worker_threads_serving", 'engine="0",worker="0",range="8"') == 2
    assert value("trioserve:worker_thread_shadow_passes_total", 'engine="0",worker="0"') == 7
    assert value("trioserve:worker_thread_shadow_seconds_total", 'engine="0",worker="0"') == (
        report.shadow_seconds
    )
    assert "# TYPE trioserve:worker_thread_shadow_thread_seconds_total counter" in text

    # Several API servers: the lines come once, from the view with the freshest engine stats.
    families = thread_families(stats)
    stale = m.state({}, {}, {}, index=1, engine_age=5.0, labelled=thread_families({1: stats[1]}))
    fresh = m.state({}, {}, {}, index=0, engine_age=0.1, labelled=families)
    merged = m.render_states({}, {}, [stale, fresh], {0: True, 1: True}, families)
    assert merged.count("trioserve:worker_threads{") == 2
    assert 'trioserve:worker_threads{model_name="tiny",engine="0",worker="0"} 2' in merged


def test_the_inventory_shows_the_reports_as_json() -> None:
    report = learned_report()
    (entry,) = thread_inventory(EngineStats(0, 0, worker_threads=encode_worker_threads([report]))) or []
    decoded = msgspec.json.decode(msgspec.json.encode(entry))
    assert decoded["configured"] == 2 and decoded["state"] == "learning" and decoded["reason"] is None
    assert decoded["ranges"]["4"]["fastest"] == 1 and decoded["ranges"]["4"]["verified"] == {"1": 2, "2": 2}
    assert decoded["ranges"]["4"]["medians"] == {"1": 1.0, "2": 2.0}
    assert decoded["shadow_thread_seconds"] == report.shadow_thread_seconds
    assert thread_inventory(None) is None and thread_inventory(EngineStats(0, 0)) == []
