"""The worker's thread tuner (worker/shadow.py) on a MockClock, over a runner whose timings and logits
are injected: what the learner decides when, as the worker's clock and its reports see it.

The runner stands in for ``ModelRunner``'s surface the tuner uses: it serves a step in the time given
for its thread count, keeps its "logits" (bytes naming the step) when asked, and re-runs a step at a
count to the same bytes, or to others for a count set to drift.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import trio
import trio.testing

from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.worker_messages import StepResult
from trioserve.worker.model_runner import ModelRunner
from trioserve.worker.shadow import ThreadTuner
from trioserve.worker.thread_learner import LearnerRules, ThreadLearner


class InjectedRunner:
    def __init__(self, seconds: dict[int, float], drifting: frozenset[int] = frozenset()) -> None:
        self.num_threads = 2
        self.threads = SimpleNamespace(sets=0, backend="injected")
        self.seconds, self.drifting = seconds, drifting
        self.golden_bytes = [b"golden", b"golden"]
        self.served_at: list[int] = []  # the count each served forward ran at
        self.reruns: list[int] = []
        self.last: Any = None
        self.last_seconds: float | None = None
        self.last_rows = 0

    @staticmethod
    def step_tokens(step: SchedulerOutput) -> int:
        return step.total_num_scheduled_tokens

    def golden(self, count: int) -> bytes:
        return self.golden_bytes.pop(0)

    def run(
        self, step: SchedulerOutput, *, threads: int | None = None, keep_logits: bool = False
    ) -> StepResult:
        count = self.num_threads if threads is None else threads
        self.served_at.append(count)
        tokens = step.total_num_scheduled_tokens
        self.last_seconds, self.last_rows = self.seconds[count], 1
        logits = f"step {step.step}".encode()
        self.last = SimpleNamespace(tokens=tokens, logits=logits) if keep_logits else None
        return StepResult(step.step, {"r": [step.step]})

    def reforward(self, count: int) -> tuple[float, bytes]:
        self.reruns.append(count)
        logits = self.last.logits
        return self.seconds[count], logits + b"!" if count in self.drifting else logits


def step(number: int, tokens: int) -> SchedulerOutput:
    return SchedulerOutput(number, [], [], {"r": tokens}, tokens, [], [])


async def serve_steps(tuner: ThreadTuner, tokens: int, count: int, results: list[StepResult]) -> None:
    """``count`` steps of ``tokens`` tokens, one a second on the (mock) clock."""
    for _ in range(count):
        await trio.sleep(1.0)
        tuner.serve(step(len(results) + 1, tokens), results.append)


def tuner_on(runner: InjectedRunner, mode: int, transition: int = 8) -> ThreadTuner:
    learner = ThreadLearner(LearnerRules(mode, 2, shadow_every=1, min_samples=2, transition=transition))
    return ThreadTuner(cast(ModelRunner, runner), learner, clock=trio.current_time)


async def test_mode_2_learns_on_the_workers_clock_and_serves_after_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runner = InjectedRunner({1: 0.010, 2: 0.030})  # one thread is faster
    tuner = tuner_on(runner, 2, transition=3)
    assert tuner.golden() and tuner.report().state == "warming"
    results: list[StepResult] = []
    # The warm pass (at 2), then 1, 2, 1, 2: the fastest (1) is decided on the fifth step, at t = 5.
    await serve_steps(tuner, 4, 5, results)
    report = tuner.report()
    assert runner.reruns == [2, 1, 2, 1, 2]
    assert report.ranges[4].fastest == 1 and report.ranges[4].learned_at == 5.0
    assert report.ranges[4].status == "verifying" and report.ranges[4].medians == {1: 0.010, 2: 0.030}
    # The window: three more verified passes at 1 (steps 6-8) while 2 still serves; then 1 serves.
    await serve_steps(tuner, 4, 4, results)
    assert runner.reruns[5:] == [1, 1, 1] and runner.served_at == [2] * 8 + [1]
    report = tuner.report()
    assert report.ranges[4].status == "serving" and report.ranges[4].serving_since == 8.0
    # Each result carried a report only after a change: every step until serving, then none.
    assert [r.threads is not None for r in results] == [True] * 8 + [True]
    await serve_steps(tuner, 4, 2, results)
    assert [r.threads for r in results[-2:]] == [None, None] and runner.reruns[8:] == []
    # Another range learns on its own: its first shadow (at 1, the least sampled count) drifts, at
    # t = 12, which retires learning for good: range 4 goes back to 2 and nothing is shadowed again.
    runner.drifting = frozenset({1})
    await serve_steps(tuner, 16, 2, results)
    report = tuner.report()
    assert runner.reruns[8:] == [1]
    assert report.state == "retired" and report.retired_at == 12.0 and report.reason is not None
    assert "range 16" in report.reason and report.ranges[4].serving == 2
    carried = results[-1].threads  # step 13's result carries the retirement (it came after step 12's)
    assert carried is not None and carried.state == "retired"
    await serve_steps(tuner, 4, 1, results)
    assert runner.served_at[-1] == 2 and results[-1].threads is None


async def test_a_failed_golden_check_means_no_shadow_ever(autojump_clock: trio.testing.MockClock) -> None:
    runner = InjectedRunner({1: 0.010, 2: 0.030})
    runner.golden_bytes = [b"golden", b"other"]
    tuner = tuner_on(runner, 1)
    await trio.sleep(2.5)
    assert not tuner.golden()
    report = tuner.report()
    assert report.state == "retired" and report.retired_at == 2.5
    assert report.reason is not None and report.reason.startswith("golden check failed")
    results: list[StepResult] = []
    await serve_steps(tuner, 4, 10, results)
    assert runner.reruns == [] and runner.served_at == [2] * 10 and tuner.report().shadow_passes == 0
