"""The worker's side of thread learning (issue 15, items 2-4): golden check, served steps, shadow passes.

``ThreadTuner`` joins the pure learner (``worker/thread_learner.py``: every decision) to the runner
(``worker/model_runner.py``: every forward). The worker's loop calls ``serve(step, answer)`` instead of
``answer(runner.run(step))``. Rules:

- **Golden first.** ``golden()`` runs before the worker says ready: a fixed prompt's forward at the
  configured count, twice, compared byte for byte; the outcome goes to ``on_golden``. A forward that
  raises fails the check (the worker still serves, at the configured count).
- **The answer goes out first.** ``serve`` serves the step at ``serve_count(tokens)`` (mode 1: always
  the configured count), hands the result to ``answer`` (the result ring) and only then asks
  ``on_served`` for a plan and runs the shadow. So a client waits for no shadow; the engine core's next
  step waits for it, which is the shadow's CPU cost, bounded by the learner's pacing (one shadow per K
  served steps). Each shadow is a re-run of that step's forward, the served logits' bytes compared with
  the shadow's (kept only when ``would_plan`` says a shadow is coming). It samples nothing and leaves
  the paged cache as the served pass left it (``ModelRunner.reforward``).
- **Only steps with logits count.** A step whose forward kept no LM-head row (a middle prefill chunk)
  has no answer to compare: it is served and not reported to the learner.
- **A shadow that raises retires learning** (reason naming the error); the worker keeps serving, at the
  configured count. A plan the runner cannot run (nothing kept) is abandoned.
- **Events are logged** as they come out of the learner: ``learned`` (range, fastest, medians),
  ``retired`` (reason), ``serving_changed`` (range, count, previous).

**The report rides on the answers** (protocol/thread_report.py): ``report()`` is the learner's
report plus the thread context's counters; ``WorkerReady`` carries it after the golden check, and a
served step's ``StepResult`` carries it only when something the report counts changed since it was
last sent (a shadow pass, an abandoned plan, retiring). A shadow runs after its step's answer, so its
outcome goes out with the next step's; between changes, the per-step counters in the engine's copy
(served steps, served medians) are as of the last change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.thread_report import WorkerThreads
from trioserve.protocol.worker_messages import StepResult
from trioserve.worker.model_runner import ModelRunner
from trioserve.worker.thread_learner import ThreadEvent, ThreadLearner, range_tokens

log = logging.getLogger("trioserve.worker")


class ThreadTuner:
    """One CPU worker's thread learning (the module docstring's rules)."""

    def __init__(
        self,
        runner: ModelRunner,
        learner: ThreadLearner,
        rank: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if learner.rules.configured != runner.num_threads:
            raise ValueError(
                f"the learner's configured count {learner.rules.configured} is not the runner's "
                f"{runner.num_threads}"
            )
        self.runner = runner
        self.learner = learner
        self.rank = rank
        self.clock = clock
        self._changed = True  # the report changed since it was last taken

    def golden(self) -> bool:
        """The start-up golden check, fed to the learner; returns whether it passed."""
        count = self.learner.rules.configured
        detail = ""
        try:
            first, second = self.runner.golden(count), self.runner.golden(count)
            passed = first == second
            if not passed:
                detail = f"two forwards of the golden prompt at {count} threads differ"
        except Exception as exc:  # a failed check must not stop the worker: it serves at one count
            log.exception("worker %d: the golden check raised", self.rank)
            passed, detail = False, f"it raised {exc!r}"
        log.info(
            "worker %d: golden check at %d threads %s%s",
            self.rank,
            count,
            "passed" if passed else "failed",
            f": {detail}" if detail else "",
        )
        self.learner.on_golden(passed, self.clock(), detail)
        self._log_events()
        self._changed = True
        return passed

    def serve(self, step: SchedulerOutput, answer: Callable[[StepResult], None]) -> StepResult:
        """Serve ``step``, answer it, then run the shadow pass the learner plans for it, if any."""
        learner, runner = self.learner, self.runner
        tokens = runner.step_tokens(step)
        if tokens == 0:  # only finished or preempted requests: no forward
            result = runner.run(step)
            self._answer(result, answer)
            return result
        count = learner.serve_count(tokens)
        result = runner.run(step, threads=count, keep_logits=learner.would_plan(tokens))
        self._answer(result, answer)
        seconds = runner.last_seconds
        if seconds is None or runner.last_rows == 0:
            return result  # no logits kept: nothing a shadow could compare
        learner.on_served_timing(tokens, count, seconds)
        plan = learner.on_served(tokens, self.clock())
        if plan is not None:
            self._changed = True
            if runner.last is None or runner.last.tokens != plan.step_tokens:
                learner.abandon(plan)
            else:
                try:
                    shadow_seconds, shadow_logits = runner.reforward(plan.count)
                except Exception as exc:
                    log.exception("worker %d: a shadow pass at %d threads raised", self.rank, plan.count)
                    learner.abandon(plan)
                    learner.retire(f"a shadow pass at {plan.count} threads raised {exc!r}", self.clock())
                else:
                    learner.on_shadow_output(
                        plan, shadow_seconds, runner.last.logits, shadow_logits, self.clock()
                    )
        runner.last = None  # the served bytes are not kept past their step
        self._log_events()
        return result

    def report(self) -> WorkerThreads:
        """The learner's report (``ThreadLearner.report``) with the thread context's counters."""
        report = self.learner.report(self.rank)
        report.set_num_threads_calls = self.runner.threads.sets
        report.parallel_backend = self.runner.threads.backend
        return report

    def take_report(self) -> WorkerThreads | None:
        """``report()`` if it changed since the last call, else None (what a ``StepResult`` carries)."""
        if not self._changed:
            return None
        self._changed = False
        return self.report()

    def _answer(self, result: StepResult, answer: Callable[[StepResult], None]) -> None:
        result.threads = self.take_report()
        answer(result)

    def _log_events(self) -> None:
        for event in self.learner.take_events():
            log_event(self.rank, event)


def log_event(rank: int, event: ThreadEvent) -> None:
    """One learner event as a log line (the test and the docs quote these words)."""
    span = ""
    if event.range is not None:
        lo, hi = range_tokens(event.range)
        span = f"range {event.range} ({lo}..{hi} tokens)"
    if event.kind == "learned":
        medians = ", ".join(f"{c}: {m * 1e3:.3f} ms" for c, m in event.medians)
        log.info(
            "worker %d: threads learned for %s: fastest %s; medians %s", rank, span, event.count, medians
        )
    elif event.kind == "retired":
        log.warning("worker %d: thread learning retired: %s", rank, event.reason)
    else:
        log.info(
            "worker %d: %s now served at %s threads (was %s): %s",
            rank,
            span,
            event.count,
            event.previous,
            event.reason,
        )
