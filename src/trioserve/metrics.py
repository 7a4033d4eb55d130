"""Prometheus metrics: vLLM's names where the meaning is the same, ``trioserve:`` for the rest.

Pure bookkeeping with no locks and no I/O: everything runs on the API server's one event loop. The
per-token cost is one histogram observation (a bisect and two adds) for the inter-token latency.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Buckets (seconds) as vLLM uses them for the same metrics, so dashboards line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    loop_lag: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS))
    output_delay: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    stream_events: int = 0  # content events written to streaming clients
    stream_tokens: int = 0  # tokens those events carried
    merged_deltas: int = 0  # deltas merged while a client was behind

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
        return "\n".join(out) + "\n"
