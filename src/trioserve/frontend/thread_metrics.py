"""The workers' thread reports (protocol/thread_report.py) as /metrics families and inventory entries.

Read at scrape time only: the reports arrive encoded inside every ``EngineStats`` and are decoded here,
never on the token path. Every family is labelled ``engine`` (the engine index) and ``worker`` (its
rank); an engine without workers (mock, reference) has no lines.

- ``trioserve:worker_threads``: the intra-op count the worker is configured with (0: not a CPU worker).
- ``trioserve:worker_thread_learning``: 1 on the line of the worker's learning state (off,
  waiting_golden, warming, learning, retired), the others 0; the reason is in the inventory.
- ``trioserve:worker_threads_learned``: per input-size range (``range`` = its largest token count) whose
  fastest count is decided, that count; ``trioserve:worker_threads_serving``: the count it is served at.
- ``trioserve:worker_thread_shadow_passes_total``, ``..._shadow_seconds_total`` (wall time) and
  ``..._shadow_thread_seconds_total`` (wall time x threads, a bound on the CPU): the shadow passes'
  cost. Counters start again from 0 when a worker is restarted with its engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args

import msgspec

from trioserve.metrics import Labelled
from trioserve.protocol.messages import EngineStats
from trioserve.protocol.thread_report import LearnerState, WorkerThreads, decode_worker_threads

STATES: tuple[str, ...] = get_args(LearnerState)


def worker_reports(stats: Mapping[int, EngineStats]) -> dict[int, list[WorkerThreads]]:
    """Engine index -> its workers' latest reports, for the engines with any."""
    out: dict[int, list[WorkerThreads]] = {}
    for index, engine in sorted(stats.items()):
        reports = decode_worker_threads(engine.worker_threads)
        if reports:
            out[index] = reports
    return out


def thread_families(stats: Mapping[int, EngineStats]) -> Labelled:
    """The module docstring's families, from the latest stats of each engine."""
    threads: list[tuple[str, float]] = []
    states: list[tuple[str, float]] = []
    learned: list[tuple[str, float]] = []
    serving: list[tuple[str, float]] = []
    passes: list[tuple[str, float]] = []
    seconds: list[tuple[str, float]] = []
    thread_seconds: list[tuple[str, float]] = []
    for index, reports in worker_reports(stats).items():
        for report in reports:
            who = f'engine="{index}",worker="{report.rank}"'
            threads.append((who, report.configured))
            states.extend((f'{who},state="{state}"', int(report.state == state)) for state in STATES)
            for rng, record in sorted(report.ranges.items()):
                where = f'{who},range="{rng}"'
                if record.fastest is not None:
                    learned.append((where, record.fastest))
                serving.append((where, record.serving))
            passes.append((who, report.shadow_passes))
            seconds.append((who, report.shadow_seconds))
            thread_seconds.append((who, report.shadow_thread_seconds))
    return {
        "trioserve:worker_threads": ("gauge", "Intra-op threads each worker is configured with.", threads),
        "trioserve:worker_thread_learning": (
            "gauge",
            "1 on the line of each worker's thread-learning state (TRIOSERVE_CPU_ADAPTIVE_THREADS).",
            states,
        ),
        "trioserve:worker_threads_learned": (
            "gauge",
            "The fastest thread count learned per input-size range (range: its largest token count).",
            learned,
        ),
        "trioserve:worker_threads_serving": (
            "gauge",
            "The thread count each input-size range is served at (differs only in learning mode 2).",
            serving,
        ),
        "trioserve:worker_thread_shadow_passes_total": (
            "counter",
            "Shadow passes run by thread learning (each a re-run of a served step at another count).",
            passes,
        ),
        "trioserve:worker_thread_shadow_seconds_total": (
            "counter",
            "Wall time of those shadow passes.",
            seconds,
        ),
        "trioserve:worker_thread_shadow_thread_seconds_total": (
            "counter",
            "Wall time x thread count of those shadow passes: a bound on the CPU they took.",
            thread_seconds,
        ),
    }


def thread_inventory(stats: EngineStats | None) -> list[object] | None:
    """One replica's workers' reports as JSON-able values (None: no stats from it yet)."""
    if stats is None:
        return None
    reports: list[object] = msgspec.to_builtins(decode_worker_threads(stats.worker_threads))
    return reports
