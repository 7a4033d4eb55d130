"""What a worker says about its CPU threads (issue 15, item 5; docs/threads.md): its configured count
and, when it learns (``worker/thread_learner.py``), the learned table and the shadow passes' cost.

It travels up in two hops:

- worker -> engine core, on the result ring: in ``WorkerReady`` (after the golden check) and in a
  ``StepResult`` only when the report changed since the last one sent (a golden check, a shadow pass,
  an abandoned plan, retiring), so an unchanged step carries ``None``. The worker answers a step before
  its shadow pass, so a shadow's outcome rides on the next step's result.
- engine core -> API servers, inside every ``EngineStats`` as ``worker_threads``: the engine keeps the
  latest report of each worker encoded once (``encode_worker_threads``) and sends those bytes as
  ``msgspec.Raw``, so a step pays a copy, not an encode, and an API server decodes them only when
  /metrics or the inventory asks (``decode_worker_threads``).

These structs are maps, not arrays (they are sent rarely and read by people: ``msgspec.to_builtins``
gives the inventory's JSON directly); fields are append-only with defaults, like every wire struct.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# off: mode 0, or a worker that cannot learn (not on the CPU, or a tensor-parallel rank). Then
# waiting_golden -> warming -> learning -> retired (final, with a reason).
LearnerState = Literal["off", "waiting_golden", "warming", "learning", "retired"]
# learning (sampling every count) -> learned (fastest decided) | verifying (mode 2's transition window)
# -> serving (mode 2: the learned count serves the range).
RangeStatus = Literal["learning", "learned", "verifying", "serving"]

# An upper bound on one encoded ``WorkerThreads`` (the result ring's slots leave room for it): at most
# 17 counts (1..16 and the configured one) in each of three per-count maps, per range; at most 32
# ranges (steps up to 2**31 tokens); a reason of at most REASON_CHARS characters (the learner cuts it).
REASON_CHARS = 1024
THREAD_REPORT_BYTES = 64 * 1024


class ThreadRange(msgspec.Struct, kw_only=True):
    """One input-size range: steps of ``tokens[0] .. tokens[1]`` computed tokens (a power of two's
    range, ``thread_learner.size_range``). Times are seconds; counts are thread counts."""

    tokens: tuple[int, int]
    status: RangeStatus = "learning"
    fastest: int | None = None  # decided once every count has min_samples verified passes
    serving: int = 0  # the count this range is served at now
    steps: int = 0  # served steps of this range
    medians: dict[int, float] = {}  # per count: median of its latest verified shadow timings
    verified: dict[int, int] = {}  # per count: shadow passes that reproduced the served logits
    served_medians: dict[int, float] = {}  # per count served: median of the served passes' timings
    transition_passes: int = 0  # mode 2: verified passes of ``fastest`` since it was decided
    learned_at: float | None = None  # the worker's monotonic clock
    serving_since: float | None = None


class WorkerThreads(msgspec.Struct, kw_only=True):
    """One worker's threads: what it was configured with, and what it learned."""

    rank: int
    configured: int  # intra-op threads it serves at (0: not a CPU worker)
    mode: int = 0  # TRIOSERVE_CPU_ADAPTIVE_THREADS
    state: LearnerState = "off"
    reason: str | None = None  # why it is off, or why learning retired
    retired_at: float | None = None
    candidates: list[int] = []
    shadow_every: int = 0  # K: served steps per shadow pass at most
    min_samples: int = 0  # M
    transition_window: int = 0  # W
    window: int = 0  # timings kept per range and count
    served_steps: int = 0  # steps with logits served since the golden check
    shadow_plans: int = 0
    shadow_passes: int = 0
    shadow_abandoned: int = 0
    shadow_seconds: float = 0.0  # wall time of all shadow passes
    shadow_thread_seconds: float = 0.0  # wall time x thread count: a bound on their CPU
    ranges: dict[int, ThreadRange] = {}  # keyed by the range's upper bound (a power of two)
    set_num_threads_calls: int = 0  # torch.set_num_threads calls the worker's thread context made
    parallel_backend: str = ""  # torch's intra-op backend (OpenMP, native)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[WorkerThreads])
NO_WORKER_THREADS = msgspec.Raw(_encoder.encode([]))  # an engine without workers (the reference, the mock)


def encode_worker_threads(reports: list[WorkerThreads]) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(reports))


def decode_worker_threads(raw: msgspec.Raw | bytes) -> list[WorkerThreads]:
    """The reports in an ``EngineStats.worker_threads``; an undecodable value reads as none (it is
    for people, and a newer engine's extra fields are skipped, not refused)."""
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
