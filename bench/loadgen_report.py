"""What a load run measured, and the arithmetic over it (``bench/sse_loadgen.py``).

``RequestRecord`` is one finished (or failed) request and ``LoadResult`` the JSON result of a run;
``_percentile``, ``_itl_ms`` and ``steady_window`` are the statistics the loop computes from its records
and samples; ``save_detailed`` writes every request. ``proc_stat_fields``, ``proc_cpu_seconds`` and
``cpu_busy_seconds`` read CPU time from /proc (the other bench scripts use them too). It imports nothing
else of the load generator: ``save_detailed`` reads a run through the ``DetailedRun`` protocol, which
``loadgen_loop.LoadGen`` satisfies, so the loop can sit above this module without a cycle.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

# ---------------------------------------------------------------------------------------------- /proc


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the ``comm`` field (index 0 is field 3, ``state``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of the whole thread group, in seconds; None if the process is gone."""
    fields = proc_stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_busy_seconds() -> dict[int, float]:
    """Busy time (everything but idle and iowait) of each CPU since boot, from /proc/stat."""
    out: dict[int, float] = {}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *vals = line.split()
            ticks = [int(v) for v in vals]
            out[int(name[3:])] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / _CLK_TCK
    return out


# ------------------------------------------------------------------------------------------ results


@dataclass(slots=True)
class RequestRecord:
    """One finished (or failed) request. Times are ``time.perf_counter()`` seconds."""

    sent_at: float
    ttft: float  # seconds; nan if no token arrived
    ended_at: float
    tokens: int
    error: str | None
    prompt: int = -1  # index into LoadGen.prompts
    events: int = 0  # token-carrying events
    itl: array[float] = field(default_factory=lambda: array("d"))  # seconds between those events


class LoadResult(msgspec.Struct):
    """What one load run measured. CPU figures are seconds of utime+stime inside the window."""

    url: str
    clients: int
    output_len: int
    window_s: float
    window_started_after_s: float
    tokens: int
    token_events: int
    sse_events: int
    tokens_per_event_hist: dict[int, int]
    no_token_ids_events: int
    bad_events: int
    requests_completed: int  # completed inside the window
    ttft_samples: int  # requests sent inside the window that got a first token
    ttft_missing: int  # ... that got none (failed, or still waiting after the grace period)
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    tpot_mean_ms: float
    wrong_length: int  # requests completed inside the window whose token count != output_len
    failures_window: dict[str, int]
    failures_total: dict[str, int]
    error_samples: list[str]
    inflight_min: int
    inflight_mean: float
    cpu_s: dict[str, float]  # watched processes (name -> seconds)
    cpu_gone: list[str]  # watched processes that died before the window ended
    client_cpu_s: float
    cpu_busy_s: dict[int, float]  # per CPU core: busy seconds in the window, every process included
    # Requests refused with 429/503 (by status: "429", "503"); not part of failures_*. The client
    # waited Retry-After (capped) before its next request.
    rejected_window: dict[str, int] = {}
    rejected_total: dict[str, int] = {}
    rejected_samples: list[str] = []  # up to 8 distinct refusal bodies (digits ignored when comparing)
    # Added with --num-prompts, WebSocket and completions support (None: no samples; a nan would be
    # written as null, which does not decode back into a float).
    mode: str = "duration"  # "duration": fixed window after warm-up; "num-prompts": steady-state window
    transport: str = "sse"
    endpoint: str = "chat"
    num_prompts: int = 0  # requests the run was to send (0: unbounded, duration mode)
    requests_sent: int = 0  # over the whole run
    requests_ok: int = 0  # over the whole run: completed without error
    run_s: float = 0.0  # first connection to the end of the run
    inflight_target: int = 0  # 95% of clients: the steady-state threshold
    steady_state: bool = True  # False: the target was never reached (window = >= 95% of the peak)
    window_start_unix: float = 0.0  # the window in wall-clock time, to match server-side samples
    window_end_unix: float = 0.0
    ttft_mean_ms: float | None = None
    itl_samples: int = 0
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    tpot_samples: int = 0
    input_tokens_mean: float | None = None  # prompt tokens per request (tokenizer mode), as generated
    output_len_mean: float | None = None  # max_tokens per request
    ignore_eos: bool = True
    client_cpu_total_s: float = 0.0  # load generator CPU over the whole run


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def _itl_ms(records: Sequence[RequestRecord]) -> list[float]:
    """Every inter-token gap of ``records``, in ms, sorted."""
    out: list[float] = []
    for r in records:
        out.extend(r.itl)
    out.sort()
    return [x * 1e3 for x in out]


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def steady_window(active: Sequence[int], target: int) -> tuple[int, int, bool]:
    """The steady-state window over samples of the number of clients active (in flight or backing
    off): from the first to the last sample with ``active >= target``. Returns ``(first, last,
    reached)``; when no sample reaches ``target``, the window is where ``active`` is at least 95% of
    its peak and ``reached`` is False. ``first == last`` means no usable window."""
    if not active:
        return 0, 0, False
    reached = max(active) >= target
    if not reached:
        target = max(1, math.ceil(0.95 * max(active)))
    first = next(i for i, a in enumerate(active) if a >= target)
    last = max(i for i, a in enumerate(active) if a >= target)
    return first, last, reached


class _PromptLengths(Protocol):
    """What ``save_detailed`` reads of a prompt (``loadgen_loop.Prompt``)."""

    @property
    def input_tokens(self) -> int: ...

    @property
    def output_len(self) -> int: ...


class DetailedRun(Protocol):
    """What ``save_detailed`` reads of a run (``loadgen_loop.LoadGen``); a protocol so that this module
    does not import the loop."""

    @property
    def prompts(self) -> Sequence[_PromptLengths]: ...

    @property
    def records(self) -> Sequence[RequestRecord]: ...


def save_detailed(path: str, gen: DetailedRun, result: LoadResult, t_origin: float) -> None:
    """Every request as JSON: times in seconds from ``t_origin`` (perf_counter), ITL gaps in seconds."""
    prompts = gen.prompts
    requests = [
        {
            "sent_at": r.sent_at - t_origin,
            "ended_at": r.ended_at - t_origin,
            "ttft": None if math.isnan(r.ttft) else r.ttft,
            "input_tokens": prompts[r.prompt].input_tokens if r.prompt >= 0 else None,
            "output_len": prompts[r.prompt].output_len if r.prompt >= 0 else None,
            "tokens": r.tokens,
            "events": r.events,
            "itl": r.itl.tolist(),
            "error": r.error,
        }
        for r in gen.records
    ]
    payload = {"result": msgspec.json.decode(msgspec.json.encode(result)), "requests": requests}
    Path(path).write_text(json.dumps(payload, allow_nan=False, default=str, separators=(",", ":")))
