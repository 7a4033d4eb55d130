"""Prometheus metrics: vLLM's names where the meaning is the same, ``trioserve:`` for the rest.

Pure bookkeeping with no locks: everything runs on the API server's one event loop. The per-token
cost is one histogram observation (a bisect and two adds) for the inter-token latency; the other
histograms are observed once per request (``observe_request``) or once per engine step
(``iteration_tokens``). The only I/O is at scrape time: the process metrics read ``/proc``.

Names vLLM dashboards query, and what they count here:

- ``vllm:time_per_output_token_seconds``: vLLM's older name of the inter-token latency (its V1 renamed
  it ``vllm:inter_token_latency_seconds`` and added ``vllm:request_time_per_output_token_seconds``);
  dashboards still use it, so the same histogram is exposed under both names.
- ``vllm:request_time_per_output_token_seconds``: per request that ran to its end, its decode time
  (first token to last) over its tokens after the first, per choice.
- ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``: per request (one observation per
  API request whatever ``n``; generation tokens summed over its choices), finished or not.
- ``vllm:iteration_tokens_total``: per engine step, the tokens it produced for this API server's
  requests plus the whole prompt of each request whose first token it produced (vLLM's attribution).
- ``process_*``: the API server process (not its engine), as prometheus_client names them.
"""

from __future__ import annotations

import bisect
import os
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Buckets (seconds) as vLLM uses them for the same metrics, so dashboards line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets for token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class Histogram:
    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, plus +Inf at the end
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> Iterable[str]:
        cumulative = 0
        sep = "," if labels else ""
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            yield f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}'
        brace = f"{{{labels}}}" if labels else ""
        yield f"{name}_sum{brace} {self.total}"
        yield f"{name}_count{brace} {self.count}"


@dataclass(slots=True)
class Metrics:
    model: str
    max_model_len: int = 8192  # the top of the token-count buckets
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    loop_lag: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS))
    output_delay: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS))
    request_tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_BUCKETS))
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    stream_events: int = 0  # content events written to streaming clients
    stream_tokens: int = 0  # tokens those events carried
    merged_deltas: int = 0  # deltas merged while a client was behind
    proc: str = "/proc"  # where the process metrics are read from

    def __post_init__(self) -> None:
        buckets = one_two_five(self.max_model_len)
        self.request_prompt_tokens = Histogram(buckets)
        self.request_generation_tokens = Histogram(buckets)

    def observe_request(
        self, prompt_tokens: int, generation_tokens: int, choices: int, decode_time: float | None
    ) -> None:
        """Once per request, as it leaves: its sizes and, when it ran to its end (``decode_time``:
        first token to last, seconds), its time per output token after the first, per choice."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        per_choice = generation_tokens / max(choices, 1)
        if decode_time is not None and per_choice > 1:
            self.request_tpot.observe(decode_time / (per_choice - 1))

    def render(
        self,
        gauges: Mapping[str, tuple[str, float]],
        counters: Mapping[str, tuple[str, float]],
        rejected: Mapping[str, int],
    ) -> str:
        """The text exposition format. ``gauges``/``counters``: name -> (help, value), read live."""
        label = f'model_name="{self.model}"'
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        for name, (help_text, value) in gauges.items():
            family(name, "gauge", help_text)
            out.append(f"{name}{{{label}}} {value}")
        for name, (help_text, value) in {
            **counters,
            "vllm:prompt_tokens_total": ("Prompt tokens processed.", self.prompt_tokens),
            "vllm:generation_tokens_total": (
                "Generated tokens streamed or returned.",
                self.generation_tokens,
            ),
            "trioserve:stream_events_total": (
                "Content events written to streaming clients.",
                self.stream_events,
            ),
            "trioserve:stream_tokens_total": (
                "Tokens in those events; rate(tokens)/rate(events) is tokens per event.",
                self.stream_tokens,
            ),
            "trioserve:merged_deltas_total": (
                "Deltas merged into a waiting chunk because the client was behind.",
                self.merged_deltas,
            ),
        }.items():
            family(name, "counter", help_text)
            out.append(f"{name}{{{label}}} {value}")
        family("trioserve:rejected_requests_total", "counter", "Requests refused at admission, by reason.")
        for reason, n in sorted(rejected.items()):
            out.append(f'trioserve:rejected_requests_total{{{label},reason="{reason}"}} {n}')
        family("vllm:request_success_total", "counter", "Finished requests by finish reason.")
        for reason, n in sorted(self.finished.items()):
            out.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {n}')
        for name, hist, help_text in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Arrival (before rendering) to first token."),
            ("vllm:inter_token_latency_seconds", self.itl, "Time between a request's token deliveries."),
            (
                "vllm:time_per_output_token_seconds",
                self.itl,
                "The inter-token latency under vLLM's older name (dashboards still query it).",
            ),
            (
                "vllm:request_time_per_output_token_seconds",
                self.request_tpot,
                "Per finished request: first to last token over the tokens after the first, per choice.",
            ),
            ("vllm:request_prompt_tokens", self.request_prompt_tokens, "Prompt tokens per request."),
            (
                "vllm:request_generation_tokens",
                self.request_generation_tokens,
                "Generated tokens per request (all its choices).",
            ),
            (
                "vllm:iteration_tokens_total",
                self.iteration_tokens,
                "Tokens per engine step: generated, plus the prompts of requests it gave a first token.",
            ),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Arrival to last token."),
            ("vllm:request_queue_time_seconds", self.queue_time, "Engine: queued to first scheduled."),
            ("trioserve:event_loop_lag_seconds", self.loop_lag, "How late the API server's loop runs."),
            (
                "trioserve:output_delay_seconds",
                self.output_delay,
                "How long each engine step waited in the API server before the output handler took it.",
            ),
        ):
            family(name, "histogram", help_text)
            out.extend(hist.lines(name, label))
        for name, kind, help_text, value in process_metrics(self.proc):
            family(name, kind, help_text)
            out.append(f"{name} {value}")
        return "\n".join(out) + "\n"


def process_metrics(proc: str = "/proc") -> list[tuple[str, str, str, float]]:
    """This process's CPU time, memory, descriptors and start time, read now from ``proc``
    (prometheus_client's names; name, type, help, value). Empty where there is no ``/proc``."""
    try:
        with open(f"{proc}/self/stat", "rb") as f:
            # The command name may hold spaces and parentheses: the fields start after the last ")".
            fields = f.read().rpartition(b")")[2].split()
        with open(f"{proc}/stat", "rb") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
        open_fds = len(os.listdir(f"{proc}/self/fd"))
    except (OSError, StopIteration, IndexError, ValueError):
        return []
    tick = os.sysconf("SC_CLK_TCK")
    # fields[0] is field 3 of proc(5): utime is 14, stime 15, starttime 22, vsize 23, rss 24.
    cpu = (int(fields[11]) + int(fields[12])) / tick
    start = boot + int(fields[19]) / tick
    soft_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [
        ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.", cpu),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
        ),
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", int(fields[20])),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            start,
        ),
        ("process_open_fds", "gauge", "Number of open file descriptors.", open_fds),
        ("process_max_fds", "gauge", "Maximum number of open file descriptors.", soft_fds),
    ]
