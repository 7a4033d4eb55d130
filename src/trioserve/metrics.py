"""Prometheus metrics: vLLM's names where the meaning is the same, ``trioserve:`` for the rest.

Pure bookkeeping with no locks: everything runs on the API server's one event loop. The per-token
cost is one histogram observation (a bisect and two adds) for the inter-token latency; the other
histograms are observed once per request (``observe_request``) or once per engine step
(``iteration_tokens``). The only I/O is at scrape time: the process metrics read ``/proc``, and the
state file (``write_state``/``read_state``).

Several API servers (design §11): each one's ``state`` is a ``MetricsState``; at scrape time the one
scraped gathers its peers' (``frontend/metrics_peers.py``) and ``render_states`` merges them: ``vllm:``
totals for the deployment, ``trioserve:`` and ``process_`` lines per API server (``api_server``
label). Nothing is added on the token path: merging costs the scrape, not the tokens (unlike
prometheus_client's multiprocess mode, which writes a mmap'd file on every observation). With one API
server the output is exactly that of one process, with no ``api_server`` label.

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
  Merged across API servers, a step that served two of them is two observations.
- ``process_*``: the API server process (not its engine), as prometheus_client names them.
"""

from __future__ import annotations

import bisect
import math
import os
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

# Families with labels of their own (beyond ``model_name``): name -> (kind, help, [(labels, value)]),
# ``labels`` already written out (``engine="0",worker="1"``). What they show comes from the engines,
# so they merge like ``ENGINE_WIDE``: the lines of the view with the freshest engine stats.
Labelled = Mapping[str, tuple[str, str, Sequence[tuple[str, float]]]]

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
        return histogram_lines(name, self.bounds, self.counts, self.total, labels)


def histogram_lines(
    name: str, bounds: Sequence[float], counts: Sequence[int], total: float, labels: str = ""
) -> Iterable[str]:
    """A histogram's exposition lines from its per-bucket ``counts`` (``+Inf`` last)."""
    cumulative = 0
    sep = "," if labels else ""
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += n
        le = "+Inf" if bound == float("inf") else repr(bound)
        yield f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}'
    brace = f"{{{labels}}}" if labels else ""
    yield f"{name}_sum{brace} {total}"
    yield f"{name}_count{brace} {cumulative}"


class HistState(msgspec.Struct, array_like=True):
    counts: list[int]  # per bucket, ``+Inf`` last (not cumulative)
    total: float


class MetricsState(msgspec.Struct, kw_only=True):
    """One API server's metrics at one moment: what a peer answers a gather with and what the state
    file holds. Values by metric name (histograms by their ``Metrics`` attribute); help texts and
    bucket bounds are not sent: every process of a deployment runs the same code."""

    index: int  # the API server's client index
    engine_age: float  # seconds since the oldest engine stats behind its engine-wide gauges arrived
    gauges: dict[str, int | float]
    counters: dict[str, int | float]
    rejected: dict[str, int]
    finished: dict[str, int]
    histograms: dict[str, HistState]
    process: dict[str, int | float]
    live: bool = True  # False once read back from a state file: gauges and process metrics stale
    # Labelled engine-wide families (``Labelled``): name -> [(labels, value)], e.g. per worker.
    labelled: dict[str, list[tuple[str, int | float]]] = {}


# What the engines report and every API server hears alike: rendered once, never summed across API
# servers (see ``Metrics.render_states``).
ENGINE_WIDE = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    }
)
# Counters the engines count (cumulative in the engine, read from its stats): an API server that is
# restarted hears them again from the engine, so its predecessor's base is not added to them.
ENGINE_COUNTED = ENGINE_WIDE | {"trioserve:engine_folded_steps_total"}

# Counters ``Metrics`` keeps itself: (name, attribute, help).
OWN_COUNTERS = (
    ("vllm:prompt_tokens_total", "prompt_tokens", "Prompt tokens processed."),
    ("vllm:generation_tokens_total", "generation_tokens", "Generated tokens streamed or returned."),
    ("trioserve:stream_events_total", "stream_events", "Content events written to streaming clients."),
    (
        "trioserve:stream_tokens_total",
        "stream_tokens",
        "Tokens in those events; rate(tokens)/rate(events) is tokens per event.",
    ),
    (
        "trioserve:merged_deltas_total",
        "merged_deltas",
        "Deltas merged into a waiting chunk because the client was behind.",
    ),
)

# Histograms in exposition order: (name, ``Metrics`` attribute, help). One histogram may be exposed
# under two names (see the module docstring).
HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "ttft", "Arrival (before rendering) to first token."),
    ("vllm:inter_token_latency_seconds", "itl", "Time between a request's token deliveries."),
    (
        "vllm:time_per_output_token_seconds",
        "itl",
        "The inter-token latency under vLLM's older name (dashboards still query it).",
    ),
    (
        "vllm:request_time_per_output_token_seconds",
        "request_tpot",
        "Per finished request: first to last token over the tokens after the first, per choice.",
    ),
    ("vllm:request_prompt_tokens", "request_prompt_tokens", "Prompt tokens per request."),
    (
        "vllm:request_generation_tokens",
        "request_generation_tokens",
        "Generated tokens per request (all its choices).",
    ),
    (
        "vllm:iteration_tokens_total",
        "iteration_tokens",
        "Tokens per engine step: generated, plus the prompts of requests it gave a first token.",
    ),
    ("vllm:e2e_request_latency_seconds", "e2e", "Arrival to last token."),
    ("vllm:request_queue_time_seconds", "queue_time", "Engine: queued to first scheduled."),
    ("trioserve:event_loop_lag_seconds", "loop_lag", "How late the API server's loop runs."),
    (
        "trioserve:output_delay_seconds",
        "output_delay",
        "How long each engine step waited in the API server before the output handler took it.",
    ),
)
HISTOGRAM_KEYS = tuple(dict.fromkeys(key for _, key, _ in HISTOGRAMS))

# prometheus_client's process metrics: name -> (type, help), in exposition order.
PROCESS_METRICS = {
    "process_cpu_seconds_total": ("counter", "Total user and system CPU time spent in seconds."),
    "process_resident_memory_bytes": ("gauge", "Resident memory size in bytes."),
    "process_virtual_memory_bytes": ("gauge", "Virtual memory size in bytes."),
    "process_start_time_seconds": ("gauge", "Start time of the process since unix epoch in seconds."),
    "process_open_fds": ("gauge", "Number of open file descriptors."),
    "process_max_fds": ("gauge", "Maximum number of open file descriptors."),
}


def _number(value: float) -> int | float:
    # A bool would encode as a msgpack bool, which ``int | float`` refuses on decode.
    return int(value) if isinstance(value, bool) else value


def _add_counts(into: dict[str, int], more: Mapping[str, int]) -> None:
    for key, n in more.items():
        into[key] = into.get(key, 0) + n


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
    base: MetricsState | None = None  # the predecessor's last state (``restore``), added to every state

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
        labelled: Labelled | None = None,
    ) -> str:
        """The text exposition format of this process alone (one API server: no ``api_server``
        label). ``gauges``/``counters``: name -> (help, value), read live."""
        state = self.state(gauges, counters, rejected, labelled=labelled)
        return self.render_states(gauges, counters, [state], labelled=labelled)

    def state(
        self,
        gauges: Mapping[str, tuple[str, float]],
        counters: Mapping[str, tuple[str, float]],
        rejected: Mapping[str, int],
        *,
        index: int = 0,
        engine_age: float = math.inf,
        labelled: Labelled | None = None,
    ) -> MetricsState:
        """This API server's metrics now, as another API server merges them (and as the state file
        keeps them): the live values plus ``base``, the predecessor's cumulative counts, for every
        counter and histogram but those the engines count (``ENGINE_COUNTED``). ``engine_age``:
        seconds since the oldest engine stats behind the engine-wide gauges arrived."""
        base = self.base
        live_counters: dict[str, int | float] = {name: _number(v) for name, (_, v) in counters.items()}
        for name, attr, _ in OWN_COUNTERS:
            live_counters[name] = getattr(self, attr)
        histograms = {
            key: HistState(list(hist.counts), hist.total) for key, hist in self._histograms().items()
        }
        out_rejected = dict(rejected)
        finished = dict(self.finished)
        if base is not None:
            for name, value in base.counters.items():
                if name in live_counters and name not in ENGINE_COUNTED:
                    live_counters[name] += value
            _add_counts(out_rejected, base.rejected)
            _add_counts(finished, base.finished)
            for key, old in base.histograms.items():
                hist = histograms.get(key)
                if hist is not None and len(hist.counts) == len(old.counts):  # same buckets only
                    hist.counts = [a + b for a, b in zip(hist.counts, old.counts, strict=True)]
                    hist.total += old.total
        return MetricsState(
            index=index,
            engine_age=engine_age,
            gauges={name: _number(v) for name, (_, v) in gauges.items()},
            counters=live_counters,
            rejected=out_rejected,
            finished=finished,
            histograms=histograms,
            process={name: value for name, _, _, value in process_metrics(self.proc)},
            labelled={
                name: [(labels, _number(v)) for labels, v in lines]
                for name, (_, _, lines) in (labelled or {}).items()
            },
        )

    def restore(self, state: MetricsState) -> None:
        """Start the cumulative counts from ``state``: this API server's predecessor's last state,
        read from its file when the supervisor restarted it. Every later ``state`` adds it back, so
        the deployment's totals never go down across the restart; what the predecessor counted
        after its last write is lost (undercounted, never shown and then taken back)."""
        self.base = state

    def _histograms(self) -> dict[str, Histogram]:
        return {key: getattr(self, key) for key in HISTOGRAM_KEYS}

    def render_states(
        self,
        gauges: Mapping[str, tuple[str, float]],
        counters: Mapping[str, tuple[str, float]],
        states: Sequence[MetricsState],
        peers_up: Mapping[int, bool] | None = None,
        labelled: Labelled | None = None,
    ) -> str:
        """The text exposition format of ``states`` merged; ``states[0]`` is this API server's own.
        Names, help and order come from ``gauges``/``counters`` (this process's; values from the
        states). ``peers_up``: None for a lone API server (no ``api_server`` label: the output is
        one process's, as dashboards knew it), else index -> whether it answered the gather, for
        every API server of the deployment. States with ``live`` False were read from a file: their
        counters and histograms count, their gauges and process metrics are stale and left out.

        - ``vllm:`` counters and histograms: summed (bucket-wise) over every state.
        - ``ENGINE_WIDE`` (the engines' gauges and cumulative counts): every API server hears the
          same engines, so a sum would count each engine once per API server; the gauges come from
          the view with the freshest engine stats, the counters are the largest seen (they only go
          up, and the largest is the most recent).
        - Other ``vllm:`` gauges: summed over the live states.
        - ``trioserve:`` and ``process_`` metrics: one line per API server, labelled
          ``api_server="<index>"`` (the saturated one is the one to see, not an average).
        - ``labelled`` families (names, kinds and help from this process's; lines from the view with
          the freshest engine stats, like ``ENGINE_WIDE``).
        """
        per_server = peers_up is not None
        label = f'model_name="{self.model}"'
        live = [s for s in states if s.live] or list(states[:1])
        fresh = min(live, key=lambda s: s.engine_age)  # the first (own) view on a tie
        by_index = sorted(states, key=lambda s: s.index)
        live_by_index = [s for s in by_index if s.live]
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        def server(s: MetricsState) -> str:
            return f'{label},api_server="{s.index}"' if per_server else label

        for name, (help_text, _) in gauges.items():
            family(name, "gauge", help_text)
            if name in ENGINE_WIDE:
                out.append(f"{name}{{{label}}} {fresh.gauges.get(name, 0)}")
            elif name.startswith("vllm:"):
                out.append(f"{name}{{{label}}} {sum(s.gauges.get(name, 0) for s in live)}")
            else:
                out.extend(
                    f"{name}{{{server(s)}}} {s.gauges[name]}" for s in live_by_index if name in s.gauges
                )
        helps = {name: help_text for name, (help_text, _) in counters.items()}
        helps.update({name: help_text for name, _, help_text in OWN_COUNTERS})
        for name, help_text in helps.items():
            family(name, "counter", help_text)
            if name in ENGINE_WIDE:
                out.append(f"{name}{{{label}}} {max(s.counters.get(name, 0) for s in states)}")
            elif name.startswith("vllm:"):
                out.append(f"{name}{{{label}}} {sum(s.counters.get(name, 0) for s in states)}")
            else:
                out.extend(
                    f"{name}{{{server(s)}}} {s.counters[name]}" for s in by_index if name in s.counters
                )
        for name, (kind, help_text, _) in (labelled or {}).items():
            family(name, kind, help_text)
            out.extend(
                f"{name}{{{label},{labels}}} {value}" for labels, value in fresh.labelled.get(name, ())
            )
        family("trioserve:rejected_requests_total", "counter", "Requests refused at admission, by reason.")
        for s in by_index:
            for reason, n in sorted(s.rejected.items()):
                out.append(f'trioserve:rejected_requests_total{{{server(s)},reason="{reason}"}} {n}')
        family("vllm:request_success_total", "counter", "Finished requests by finish reason.")
        finished: dict[str, int] = {}
        for s in states:
            _add_counts(finished, s.finished)
        for reason, n in sorted(finished.items()):
            out.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {n}')
        own = self._histograms()
        for name, key, help_text in HISTOGRAMS:
            family(name, "histogram", help_text)
            bounds = own[key].bounds
            size = len(bounds) + 1
            if name.startswith("vllm:"):
                counts = [0] * size
                total = 0.0
                for s in states:
                    hist = s.histograms.get(key)
                    if hist is not None and len(hist.counts) == size:  # other buckets cannot be added
                        counts = [a + b for a, b in zip(counts, hist.counts, strict=True)]
                        total += hist.total
                out.extend(histogram_lines(name, bounds, counts, total, label))
            else:
                for s in by_index:
                    hist = s.histograms.get(key)
                    if hist is not None and len(hist.counts) == size:
                        out.extend(histogram_lines(name, bounds, hist.counts, hist.total, server(s)))
        for name, (kind, help_text) in PROCESS_METRICS.items():
            values = [(s, s.process[name]) for s in live_by_index if name in s.process]
            if values:
                family(name, kind, help_text)
            for s, value in values:
                out.append(f'{name}{{api_server="{s.index}"}} {value}' if per_server else f"{name} {value}")
        if peers_up is not None:
            family(
                "trioserve:metrics_peers_missing",
                "gauge",
                "API servers that did not answer this scrape's gather (their last saved counts are used).",
            )
            out.append(
                f"trioserve:metrics_peers_missing{{{label}}} {sum(not up for up in peers_up.values())}"
            )
            family(
                "trioserve:metrics_peer_up", "gauge", "1 if that API server answered this scrape's gather."
            )
            for index, up in sorted(peers_up.items()):
                out.append(f'trioserve:metrics_peer_up{{{label},api_server="{index}"}} {int(up)}')
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
    values: dict[str, float] = {
        "process_cpu_seconds_total": cpu,
        "process_resident_memory_bytes": int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
        "process_virtual_memory_bytes": int(fields[20]),
        "process_start_time_seconds": start,
        "process_open_fds": open_fds,
        "process_max_fds": soft_fds,
    }
    return [(name, kind, help_text, values[name]) for name, (kind, help_text) in PROCESS_METRICS.items()]


# ---- the state file ---------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MetricsState)


def encode_state(state: MetricsState) -> bytes:
    return _encoder.encode(state)


def decode_state(data: bytes) -> MetricsState | None:
    """None for bytes that are not a ``MetricsState`` (a peer of another version, a torn file)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def state_path(ipc_dir: str, index: int) -> str:
    return os.path.join(ipc_dir, f"metrics_{index}.state")


def write_state(path: str, state: MetricsState) -> None:
    """Replace the file at ``path`` with ``state``, atomically (a new file renamed over the old), so
    a reader never sees a torn one. No fsync: the file must outlive the process, not the machine
    (the page cache keeps it), and a few KB written to the page cache cost microseconds."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(encode_state(state))
    os.replace(tmp, path)


def read_state(path: str) -> MetricsState | None:
    """The state written at ``path``, marked not live; None when there is none or it does not decode."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    state = decode_state(data)
    return None if state is None else msgspec.structs.replace(state, live=False)
