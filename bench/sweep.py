"""Frontend-ceiling sweep: seed 000's "Where the frontend runs out" for trioserve (design §12, issue 6).

For each concurrency it starts ``python -m trioserve serve --engine mock --step-interval-us …`` pinned to
one core (its EngineCore child inherits the pin), warms it up, and runs the closed-loop load generator
(``sse_loadgen.py``) pinned to another core with ``--num-prompts`` = factor x concurrency (6 x by default,
as vllm-bench in the seed), random prompts of exactly ``--input-len`` tokens (built-in Qwen3 tokenizer),
``max_tokens`` ``--output-len`` with ``ignore_eos`` and ``return_token_ids``. Throughput and CPU are
counted over the steady-state window (at least 95% of the clients in flight). While it runs it polls the
server's ``/metrics`` for the engine's batch (``vllm:num_requests_running``) and shows progress.

Per point: client tokens/s, engine batch, TTFT p50/p99, mean TPOT, tokens per SSE event, failed
connections and other failures, rejections (429/503), and the CPU (cores, and µs per token) of the API
server, the engine core and the load generator from ``/proc/PID/stat``. It prints seed 000's table as
Markdown, and writes to ``--out-dir`` (default ``bench/results``): ``NAME.md`` (the tables), ``NAME.json``
(every raw result and metrics sample) and two plots, ``NAME_throughput_ttft.png`` (tokens/s and TTFT
against clients) and ``NAME_cpu.png`` (CPU µs per token and cores against clients).

    .venv/bin/python bench/sweep.py                      # 64,128,256,512,1024 clients
    .venv/bin/python bench/sweep.py --concurrency 64,256 --num-prompts-factor 3
    .venv/bin/python bench/sweep.py --duration 10        # fixed 10 s windows instead of N prompts

Every process it starts is stopped by PID (SIGTERM, then SIGKILL), also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from frontend_cost import Proc, find_engine, free_port, managed, raise_nofile_limit, spawn, wait_healthy
from loadgen_report import proc_stat_fields
from sse_loadgen import served_model

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TARGET_US_PER_TOKEN = 25.0  # issue 2's target for the API server at one token per event

# /metrics series the sweep samples: gauges averaged over the window, counters differenced.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "trioserve:requests_in_flight")
COUNTERS = (
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "trioserve:rejected_requests_total",
    "trioserve:stream_events_total",
    "trioserve:stream_tokens_total",
    "trioserve:output_queue_coalesced_total",
    "trioserve:merged_deltas_total",
)


# ------------------------------------------------------------------------------------ pure helpers


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str, names: Iterable[str] = GAUGES + COUNTERS) -> dict[str, float]:
    """Values of the named series in Prometheus text format, summed over their label sets."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None or m.group(1) not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


MetricSample = tuple[float, dict[str, float]]  # (unix time, series -> value)


def window_mean(samples: Sequence[MetricSample], name: str, t0: float, t1: float) -> float:
    """Mean of gauge ``name`` over the samples taken inside [t0, t1]; without any, the sample nearest to
    the window's middle; nan if there is none at all."""
    inside = [v[name] for t, v in samples if t0 <= t <= t1 and name in v]
    if inside:
        return sum(inside) / len(inside)
    have = [(abs(t - (t0 + t1) / 2), v[name]) for t, v in samples if name in v]
    return min(have)[1] if have else math.nan


def counter_rate(samples: Sequence[MetricSample], name: str, t0: float, t1: float) -> float:
    """Per-second rate of counter ``name`` between the first and last sample inside [t0, t1]."""
    inside = [(t, v[name]) for t, v in samples if t0 <= t <= t1 and name in v]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return math.nan
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _num(x: Any) -> float:
    """A JSON number, or nan for null/absent (msgspec writes nan as null)."""
    return math.nan if x is None else float(x)


@dataclass
class Point:
    """One load point, derived from the load generator's result and the server's /metrics samples."""

    clients: int
    num_prompts: int
    error: str | None = None
    window_s: float = math.nan
    steady_state: bool = False
    tokens_per_s: float = math.nan
    engine_batch: float = math.nan  # mean vllm:num_requests_running over the window
    engine_waiting: float = math.nan
    engine_tokens_per_s: float = math.nan  # rate of vllm:generation_tokens_total over the window
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    tpot_mean_ms: float = math.nan
    itl_p99_ms: float = math.nan
    tokens_per_event: float = math.nan
    max_tokens_per_event: int = 0
    requests_sent: int = 0
    requests_ok: int = 0
    failed_connect: int = 0  # refused / failed TCP connects (and WebSocket handshakes), whole run
    failed_other: int = 0  # HTTP errors, truncated streams, error events, whole run
    rejected: int = 0  # 429/503 refusals, whole run
    api_cores: float = math.nan
    engine_cores: float = math.nan
    client_cores: float = math.nan
    api_us_per_token: float = math.nan
    engine_us_per_token: float = math.nan
    client_us_per_event: float = math.nan
    client_us_per_token: float = math.nan
    other_load_server_core: float = math.nan  # busy time on the server's core not charged to us
    other_load_client_core: float = math.nan
    inflight_min: int = 0
    server_cpus: list[int] = field(default_factory=list)
    engine_cpus: list[int] = field(default_factory=list)
    client_cpus: list[int] = field(default_factory=list)

    @property
    def failed_connect_pct(self) -> float:
        attempts = self.requests_sent + self.failed_connect
        return 100.0 * self.failed_connect / attempts if attempts else math.nan


def make_point(
    clients: int,
    num_prompts: int,
    result: dict[str, Any],
    metrics: Sequence[MetricSample],
    *,
    server_cpus: Sequence[int] = (),
    engine_cpus: Sequence[int] = (),
    client_cpus: Sequence[int] = (),
) -> Point:
    """Everything the tables need from one ``LoadResult`` (as decoded JSON) and its metrics samples."""
    w = _num(result.get("window_s"))
    tokens = int(result.get("tokens", 0))
    events = int(result.get("token_events", 0))
    sse_events = int(result.get("sse_events", 0))
    cpu = result.get("cpu_s") or {}
    api = _num(cpu.get("server"))
    eng = _num(cpu.get("engine"))
    cli = _num(result.get("client_cpu_s"))
    t0 = _num(result.get("window_start_unix"))
    t1 = _num(result.get("window_end_unix"))
    failures = result.get("failures_total") or {}
    connect = sum(v for k, v in failures.items() if k in ("connect", "ws handshake"))
    hist = {int(k): v for k, v in (result.get("tokens_per_event_hist") or {}).items() if v}
    busy = {int(k): v for k, v in (result.get("cpu_busy_s") or {}).items()}

    def other(cpus: Sequence[int], ours: float) -> float:
        if len(cpus) != 1 or cpus[0] not in busy or not w > 0:
            return math.nan
        return (busy[cpus[0]] - ours) / w

    on_server_core = api + (eng if list(engine_cpus) == list(server_cpus) else 0.0)
    ok = w > 0 and tokens > 0
    return Point(
        clients=clients,
        num_prompts=num_prompts,
        window_s=w,
        steady_state=bool(result.get("steady_state", False)),
        tokens_per_s=tokens / w if w > 0 else math.nan,
        engine_batch=window_mean(metrics, "vllm:num_requests_running", t0, t1),
        engine_waiting=window_mean(metrics, "vllm:num_requests_waiting", t0, t1),
        engine_tokens_per_s=counter_rate(metrics, "vllm:generation_tokens_total", t0, t1),
        ttft_p50_ms=_num(result.get("ttft_p50_ms")),
        ttft_p99_ms=_num(result.get("ttft_p99_ms")),
        tpot_mean_ms=_num(result.get("tpot_mean_ms")),
        itl_p99_ms=_num(result.get("itl_p99_ms")),
        tokens_per_event=tokens / events if events else math.nan,
        max_tokens_per_event=max(hist) if hist else 0,
        requests_sent=int(result.get("requests_sent", 0)),
        requests_ok=int(result.get("requests_ok", 0)),
        failed_connect=connect,
        failed_other=sum(failures.values()) - connect,
        rejected=sum((result.get("rejected_total") or {}).values()),
        api_cores=api / w if w > 0 else math.nan,
        engine_cores=eng / w if w > 0 else math.nan,
        client_cores=cli / w if w > 0 else math.nan,
        api_us_per_token=api * 1e6 / tokens if ok else math.nan,
        engine_us_per_token=eng * 1e6 / tokens if ok else math.nan,
        client_us_per_event=cli * 1e6 / sse_events if sse_events else math.nan,
        client_us_per_token=cli * 1e6 / tokens if ok else math.nan,
        other_load_server_core=other(server_cpus, on_server_core),
        other_load_client_core=other(client_cpus, cli),
        inflight_min=int(result.get("inflight_min", 0)),
        server_cpus=list(server_cpus),
        engine_cpus=list(engine_cpus),
        client_cpus=list(client_cpus),
    )


def fmt(x: float, digits: int = 0, unit: str = "") -> str:
    """``12,784``; ``10.00 ms``; ``n/a`` for nan."""
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:,.{digits}f}{unit}"


def fmt_ms(x: float) -> str:
    """A latency the way the seed writes it: whole ms (``11 ms``, ``4,431 ms``), one decimal below 10."""
    return fmt(x, 1 if x < 10 else 0, " ms")


def _md(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def seed_table(points: Sequence[Point], event_word: str = "SSE event") -> str:
    """Seed 000's table: Clients | Client tokens/s | Engine batch | TTFT p50 | Mean TPOT | Tokens per SSE
    event | API server CPU."""
    head = [
        "Clients",
        "Client tokens/s",
        "Engine batch",
        "TTFT p50",
        "Mean TPOT",
        f"Tokens per {event_word}",
        "API server CPU",
    ]
    rows = []
    for p in points:
        if p.error is not None:
            rows.append([fmt(p.clients), "error", "", "", "", "", ""])
            continue
        rows.append(
            [
                fmt(p.clients),
                fmt(p.tokens_per_s),
                fmt(p.engine_batch),
                fmt_ms(p.ttft_p50_ms),
                fmt(p.tpot_mean_ms, 2, " ms"),
                fmt(p.tokens_per_event, 1),
                fmt(p.api_cores, 2, " cores"),
            ]
        )
    return _md(head, rows)


def frontend_table(points: Sequence[Point], label: str) -> str:
    """Seed 000's frontend comparison layout, for the largest concurrency measured."""
    head = ["Frontend", "Client tokens/s", "Engine batch", "TTFT p50", "Failed to connect", "Frontend CPU"]
    done = [p for p in points if p.error is None]
    if not done:
        return _md(head, [])
    p = max(done, key=lambda q: q.clients)
    row = [
        f"{label} ({fmt(p.clients)} clients)",
        fmt(p.tokens_per_s),
        fmt(p.engine_batch),
        fmt_ms(p.ttft_p50_ms),
        fmt(p.failed_connect_pct, 0, "%"),
        fmt(p.api_cores, 2, " cores"),
    ]
    return _md(head, [row])


def detail_table(points: Sequence[Point]) -> str:
    """What the seed's table leaves out: tails, failures, per-process CPU, window quality."""
    head = [
        "Clients",
        "Requests (ok/sent)",
        "Window",
        "TTFT p99",
        "ITL p99",
        "Max tokens/event",
        "Failed connections",
        "Other failures",
        "Rejected 429/503",
        "API µs/token",
        "Engine core CPU",
        "Engine µs/token",
        "Load generator CPU",
        "Client µs/event",
        "Min in flight",
        "Other load srv/cli core",
    ]
    rows = []
    for p in points:
        if p.error is not None:
            rows.append([fmt(p.clients), "error", *[""] * (len(head) - 2)])
            continue
        rows.append(
            [
                fmt(p.clients),
                f"{p.requests_ok:,}/{p.requests_sent:,}",
                fmt(p.window_s, 1, " s") + ("" if p.steady_state else " (not steady)"),
                fmt_ms(p.ttft_p99_ms),
                fmt_ms(p.itl_p99_ms),
                str(p.max_tokens_per_event),
                f"{p.failed_connect:,} ({fmt(p.failed_connect_pct, 1, '%')})",
                f"{p.failed_other:,}",
                f"{p.rejected:,}",
                fmt(p.api_us_per_token, 1),
                fmt(p.engine_cores, 2, " cores"),
                fmt(p.engine_us_per_token, 1),
                fmt(p.client_cores, 2, " cores"),
                fmt(p.client_us_per_event, 1),
                f"{p.inflight_min:,}/{p.clients:,}",
                f"{fmt(p.other_load_server_core, 2)}/{fmt(p.other_load_client_core, 2)}",
            ]
        )
    return _md(head, rows)


def notes(points: Sequence[Point], step_us: int) -> list[str]:
    out: list[str] = []
    for p in points:
        tag = f"{p.clients:,} clients"
        if p.error is not None:
            out.append(f"- {tag}: {p.error.splitlines()[0] if p.error else 'error'}")
            continue
        if not p.steady_state:
            out.append(
                f"- {tag}: fewer than 95% of the clients were ever in flight together; no steady state"
            )
        expected = p.clients * 1e6 / step_us
        if p.tokens_per_s < 0.97 * expected:
            out.append(
                f"- {tag}: {p.tokens_per_s:,.0f} of the {expected:,.0f} tokens/s a full batch would stream "
                f"({100 * p.tokens_per_s / expected:.0f}%)"
            )
        if p.other_load_server_core > 0.2 or p.other_load_client_core > 0.2:
            out.append(
                f"- {tag}: {fmt(p.other_load_server_core, 2)} / {fmt(p.other_load_client_core, 2)} cores of "
                "other load on the server / client core in the window; figures are noisy"
            )
        if p.client_cores > 0.85:
            out.append(
                f"- {tag}: the load generator used {p.client_cores:.2f} cores; it may be the bottleneck"
            )
    return out


# ------------------------------------------------------------------------------------------- plots


def plot(points: Sequence[Point], step_us: int, out_prefix: Path, title: str) -> list[Path]:
    """Two PNGs; returns their paths (none if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print("[sweep] matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    pts = [p for p in points if p.error is None]
    if not pts:
        return []
    x = [p.clients for p in pts]
    paths = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    ax1.plot(x, [p.tokens_per_s for p in pts], "o-", label="client tokens/s")
    ax1.plot(
        x, [p.engine_batch * 1e6 / step_us for p in pts], "s--", label=f"engine batch x {1e6 / step_us:g}/s"
    )
    ax1.plot(x, [c * 1e6 / step_us for c in x], ":", color="grey", label="every client at the step rate")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(x, [f"{c:,}" for c in x])
    ax1.set_xlabel("clients (closed loop)")
    ax1.set_ylabel("tokens/s")
    ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax1.set_title("Throughput")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    ax2.plot(x, [p.ttft_p50_ms for p in pts], "o-", label="TTFT p50")
    ax2.plot(x, [p.ttft_p99_ms for p in pts], "s--", label="TTFT p99")
    ax2.plot(x, [p.tpot_mean_ms for p in pts], "^:", label="mean TPOT")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
    ax2.yaxis.set_minor_formatter(NullFormatter())
    ax2.set_xticks(x, [f"{c:,}" for c in x])
    ax2.set_xlabel("clients (closed loop)")
    ax2.set_ylabel("ms")
    ax2.set_title("Time to first token (and mean TPOT)")
    ax2.grid(True, alpha=0.3, which="both")
    ax2.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out_prefix.with_name(out_prefix.name + "_throughput_ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    ax1.plot(x, [p.api_us_per_token for p in pts], "o-", label="API server")
    ax1.plot(x, [p.engine_us_per_token for p in pts], "s--", label="engine core (mock)")
    ax1.plot(
        x,
        [p.client_us_per_token for p in pts],
        "^:",
        label="load generator",
    )
    ax1.axhline(
        TARGET_US_PER_TOKEN, color="grey", linestyle=":", label=f"{TARGET_US_PER_TOKEN:g} µs target (API)"
    )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(x, [f"{c:,}" for c in x])
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("clients (closed loop)")
    ax1.set_ylabel("CPU µs per streamed token")
    ax1.set_title("CPU per token")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    ax2.plot(x, [p.api_cores for p in pts], "o-", label="API server")
    ax2.plot(x, [p.engine_cores for p in pts], "s--", label="engine core (mock)")
    ax2.plot(x, [p.api_cores + p.engine_cores for p in pts], "d-", label="both (one pinned core)")
    ax2.plot(x, [p.client_cores for p in pts], "^:", label="load generator")
    ax2.axhline(1.0, color="grey", linestyle=":")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(x, [f"{c:,}" for c in x])
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("clients (closed loop)")
    ax2.set_ylabel("cores")
    ax2.set_title("CPU used")
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out_prefix.with_name(out_prefix.name + "_cpu.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


# ------------------------------------------------------------------------------------- processes


class Interrupted(BaseException):
    """SIGTERM / SIGHUP: unwind like Ctrl-C so that every started process is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def raise_priority(proc: Proc, nice: int) -> None:
    """Apply ``nice`` to the process's autogroup too. With ``sched_autogroup_enabled`` a process's nice
    only ranks it within its session's group, and every process the sweep starts leads a session of its
    own; so ``nice`` alone does not help against other sessions on a shared machine, the group's nice
    (``/proc/PID/autogroup``) does. Negative values need root."""
    if not nice:
        return
    try:
        Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))
    except OSError as e:
        say(f"  could not set the autogroup nice of {proc.name} (pid {proc.pid}): {e}")


def _affinity(pid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def warm_up(port: int, model: str, n: int = 4) -> None:
    """A few small requests so that first-use costs (renderer start, template compile) and the loop lag
    they cause land before the load, not in its first TTFTs or as 503s."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
    ).encode()
    for _ in range(n):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with contextlib.suppress(OSError):
            urllib.request.urlopen(req, timeout=30).read()
    time.sleep(1.0)  # let the loop-lag sample settle


def run_point(
    args: argparse.Namespace, clients: int, log_dir: Path, idx: int, total: int
) -> tuple[Point, dict[str, Any]]:
    num_prompts = max(1, round(args.num_prompts_factor * clients))
    port = free_port()
    tag = f"{idx:02d}-{clients}"
    py = sys.executable
    raw: dict[str, Any] = {"clients": clients, "num_prompts": num_prompts}
    with managed([]) as procs:
        argv = [
            py,
            "-m",
            "trioserve",
            "serve",
            "--engine",
            "mock",
            "--step-interval-us",
            str(args.step_interval_us),
        ]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs)]
        argv += args.server_arg
        server = spawn(f"{tag}-server", argv, args.server_cpu, log_dir, args.nice)
        procs.append(server)
        raise_priority(server, args.nice)
        mode = f"{num_prompts:,} prompts" if args.duration is None else f"{args.duration:g} s window"
        say(
            f"{idx}/{total}: {clients:,} clients, {mode}: starting trioserve "
            f"(pid {server.pid}, cpu {args.server_cpu})"
        )
        wait_healthy(server, port, args.startup_timeout)
        engine_pid = find_engine(server.pid)
        watch = {"server": server.pid}
        engine_cpus: list[int] = []
        if engine_pid is not None:
            fields = proc_stat_fields(engine_pid)
            procs.insert(0, Proc("engine", engine_pid, int(fields[19]) if fields else -1))
            watch["engine"] = engine_pid
            engine_cpus = _affinity(engine_pid)
        else:
            say("  EngineCore child not found; engine CPU not reported")
        server_cpus = _affinity(server.pid)
        model = served_model("127.0.0.1", port) or "mock"
        warm_up(port, model)
        result_path = log_dir / f"{tag}-result.json"
        lg = [py, str(BENCH_DIR / "sse_loadgen.py"), "--port", str(port), "--model", model]
        lg += ["--max-concurrency", str(clients), "--request-rate", str(args.request_rate)]
        lg += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
        lg += ["--random-range-ratio", str(args.range_ratio), "--endpoint", args.endpoint]
        lg += ["--transport", args.transport, "--result-file", str(result_path), "--seed", str(idx)]
        if args.tokenizer:
            lg += ["--tokenizer", args.tokenizer]
        if args.duration is None:
            lg += ["--num-prompts", str(num_prompts), "--max-duration", str(args.max_point_s)]
        else:
            ramp = clients / args.request_rate
            lg += ["--duration", str(args.duration), "--warmup", str(ramp + args.warmup)]
        if args.save_detailed:
            lg += ["--save-detailed", str(Path(args.out_dir) / f"{args.name}_detailed_{clients}.json")]
        for name, pid in watch.items():
            lg += ["--watch", f"{name}={pid}"]
        loadgen = spawn(f"{tag}-loadgen", lg, args.client_cpu, log_dir, args.nice)
        procs.append(loadgen)
        raise_priority(loadgen, args.nice)
        client_cpus = _affinity(loadgen.pid)
        say(
            f"  engine pid {engine_pid} on cpus {engine_cpus}; "
            f"load generator pid {loadgen.pid} on cpus {client_cpus}"
        )
        metrics: list[MetricSample] = []
        t_start = time.monotonic()
        last_progress = t_start
        limit = args.max_point_s + 120 if args.duration is None else args.duration + args.warmup + 120
        assert loadgen.popen is not None
        while loadgen.popen.poll() is None:
            if time.monotonic() - t_start > limit:
                raise RuntimeError(f"load generator still running after {limit:.0f}s")
            if not server.alive():
                raise RuntimeError(f"server died during the run:\n{server.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                metrics.append(
                    (time.time(), parse_metrics(_get(f"http://127.0.0.1:{port}/metrics").decode()))
                )
            now = time.monotonic()
            if now - last_progress >= args.progress_every and len(metrics) >= 2:
                last_progress = now
                progress(clients, num_prompts, now - t_start, metrics, args.duration is not None)
            time.sleep(args.metrics_interval)
        rc = loadgen.popen.returncode
        if rc != 0 or not result_path.exists():
            raise RuntimeError(f"load generator failed (rc {rc}):\n{loadgen.log_tail()}")
        result = json.loads(result_path.read_text())
        raw.update(
            result=result,
            metrics=[{"t": t, **v} for t, v in metrics],
            server_pid=server.pid,
            engine_pid=engine_pid,
            loadgen_pid=loadgen.pid,
            server_cpus=server_cpus,
            engine_cpus=engine_cpus,
            client_cpus=client_cpus,
            loadgen_log_tail=loadgen.log_tail(8),
        )
        point = make_point(
            clients,
            num_prompts,
            result,
            metrics,
            server_cpus=server_cpus,
            engine_cpus=engine_cpus,
            client_cpus=client_cpus,
        )
        say(
            f"  -> {fmt(point.tokens_per_s)} tokens/s, batch {fmt(point.engine_batch)}, TTFT p50 "
            f"{fmt_ms(point.ttft_p50_ms)} p99 {fmt_ms(point.ttft_p99_ms)}, {fmt(point.tokens_per_event, 2)} "
            f"tokens/event, API {fmt(point.api_cores, 2)} cores ({fmt(point.api_us_per_token, 1)} µs/token), "
            f"window {fmt(point.window_s, 1)} s of {fmt(_num(result.get('run_s')), 1)} s"
        )
        return point, raw


def progress(
    clients: int, num_prompts: int, elapsed: float, metrics: Sequence[MetricSample], timed: bool
) -> None:
    (ta, a), (tb, b) = metrics[max(0, len(metrics) - 5)], metrics[-1]
    rate = (b.get("vllm:generation_tokens_total", 0) - a.get("vllm:generation_tokens_total", 0)) / max(
        tb - ta, 1e-9
    )
    done = int(b.get("vllm:request_success_total", 0) - metrics[0][1].get("vllm:request_success_total", 0))
    of = "" if timed else f"/{num_prompts:,}"
    say(
        f"  {elapsed:5.1f} s: {done:,}{of} requests finished, "
        f"batch {b.get('vllm:num_requests_running', 0):.0f}, "
        f"{rate:,.0f} tokens/s, {int(b.get('trioserve:rejected_requests_total', 0)):,} rejected"
    )


def say(msg: str) -> None:
    print(f"[sweep] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- reports


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{os.cpu_count()} CPUs ({model or platform.machine()}), Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def git_state() -> str:
    """``abc1234`` or ``abc1234 + uncommitted changes``: what the measured trioserve was."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "src"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + uncommitted changes in src/" if dirty else head


def report(
    args: argparse.Namespace,
    points: Sequence[Point],
    meta: dict[str, str],
    plots: Sequence[Path],
    partial: bool,
) -> str:
    """The Markdown file: setup, seed 000's table, the comparison row, the detail table, notes, plots.
    ``meta``: ``command``, ``when`` (ISO time), ``machine``, ``git``."""
    done = [p for p in points if p.error is None]
    srv = ",".join(map(str, done[0].server_cpus)) if done else str(args.server_cpu)
    eng = ",".join(map(str, done[0].engine_cpus)) if done else "?"
    cli = ",".join(map(str, done[0].client_cpus)) if done else str(args.client_cpu)
    load = (
        f"{args.num_prompts_factor:g} x clients requests per point, throughput over the steady-state window "
        "(≥ 95% of the clients in flight)"
        if args.duration is None
        else f"a {args.duration:g} s window per point after warm-up, once ≥ 95% of the clients are in flight"
    )
    event_word = "SSE event" if args.transport == "sse" else "WebSocket message"
    parts = [
        f"# Frontend ceiling sweep{' (partial: interrupted)' if partial else ''}",
        "",
        f"Measured {meta['when']} on {meta['machine']}; trioserve at {meta['git']}.",
        "",
        f"    {meta['command']}",
        "",
        "Setup (design §12, seed 000): "
        f"`trioserve serve --engine mock --step-interval-us {args.step_interval_us}` "
        f"(one engine step every {args.step_interval_us / 1000:g} ms, so "
        f"{1e6 / args.step_interval_us:g} tokens/s per running request) "
        f"with `--max-num-seqs {args.max_num_seqs}`"
        + (f" and `{' '.join(args.server_arg)}`" if args.server_arg else " and default admission settings")
        + f"; API server pinned to cpu {srv}, its EngineCore child on cpu {eng} (inherited), "
        "the load generator "
        f"(`bench/sse_loadgen.py`, closed loop, one connection per client) on cpu {cli}. Streamed "
        f"{'chat ' if args.endpoint == 'chat' else ''}completions over {args.transport.upper()}, "
        f"{args.input_len}-token random prompts (built-in Qwen3 tokenizer; the chat template adds a few), "
        f"`max_tokens` {args.output_len}, `ignore_eos`, `return_token_ids`; first connections spread at "
        f"{args.request_rate:g}/s; {load}. CPU is utime+stime from `/proc/PID/stat` over the window; "
        "engine batch is the mean of `vllm:num_requests_running` sampled from `/metrics` in the window.",
        "",
        seed_table(points, event_word),
        "",
        "The same runs, in seed 000's frontend-comparison layout (largest concurrency):",
        "",
        frontend_table(points, "trioserve, one API server"),
        "",
        "More from the same runs (requests, failures and rejections over the whole run; "
        "the rest over the window):",
        "",
        detail_table(points),
    ]
    extra = notes(points, args.step_interval_us)
    if extra:
        parts += ["", *extra]
    if plots:
        parts += ["", "Plots: " + ", ".join(f"[{p.name}]({p.name})" for p in plots), ""]
        parts += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(parts) + "\n"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Frontend-ceiling sweep of trioserve against the mock engine (seed 000's tables, plots)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--concurrency", default="64,128,256,512,1024", help="comma list of client counts")
    ap.add_argument(
        "--num-prompts-factor", type=float, default=6.0, help="requests per point = factor x clients"
    )
    ap.add_argument(
        "--duration", type=float, default=None, help="instead: a fixed window of this many s per point"
    )
    ap.add_argument(
        "--warmup", type=float, default=2.0, help="with --duration: s after the ramp before the window"
    )
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=256, help="max_tokens (ignore_eos)")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len x [1-r, 1+r]")
    ap.add_argument("--tokenizer", default=None, help="for the prompts (default: trioserve's built-in Qwen3)")
    ap.add_argument("--request-rate", type=float, default=400.0, help="first connections per second")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--transport", choices=("sse", "ws"), default="sse")
    ap.add_argument("--step-interval-us", type=int, default=10000, help="mock engine step clock")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for trioserve serve")
    ap.add_argument(
        "--server-cpu", type=int, default=0, help="core for the API server (the engine inherits it)"
    )
    ap.add_argument("--client-cpu", type=int, default=1, help="core for the load generator (and this driver)")
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="nice level, and autogroup nice, of server and load generator (negative needs root)",
    )
    ap.add_argument("--max-point-s", type=float, default=300.0, help="stop a point's load after this many s")
    ap.add_argument("--metrics-interval", type=float, default=0.5, help="s between /metrics samples")
    ap.add_argument("--progress-every", type=float, default=5.0, help="s between progress lines")
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--out-dir", default=str(BENCH_DIR / "results"))
    ap.add_argument("--name", default="frontend_ceiling", help="file name prefix in --out-dir")
    ap.add_argument("--save-detailed", action="store_true", help="also save every request (large JSON)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--keep-logs", action="store_true", help="keep the per-process logs")
    ap.add_argument(
        "--report-only",
        default=None,
        metavar="JSON",
        help="measure nothing: rebuild NAME.md and the plots from a saved NAME.json (next to it)",
    )
    args = ap.parse_args(argv)
    if args.report_only:
        return report_only(Path(args.report_only))
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency {args.concurrency!r}: a comma list of integers")
    usable = os.sched_getaffinity(0)
    for opt in ("server_cpu", "client_cpu"):
        if getattr(args, opt) not in usable:
            ap.error(
                f"--{opt.replace('_', '-')} {getattr(args, opt)}: not among the usable CPUs {sorted(usable)}"
            )
    if args.server_cpu == args.client_cpu:
        say("warning: server and load generator share a core")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {args.client_cpu})  # this driver's /metrics polling stays off the server's core
    raise_nofile_limit()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGHUP, _raise_interrupted)

    given = sys.argv[1:] if argv is None else argv
    command = " ".join([".venv/bin/python bench/sweep.py", *map(shlex.quote, given)])
    log_dir = Path(tempfile.mkdtemp(prefix="sweep."))
    points: list[Point] = []
    raws: list[dict[str, Any]] = []
    status = 0
    t0 = time.monotonic()
    try:
        for i, clients in enumerate(levels, 1):
            try:
                point, raw = run_point(args, clients, log_dir, i, len(levels))
            except RuntimeError as e:
                say(f"  {clients:,} clients failed: {e}")
                point = Point(clients, round(args.num_prompts_factor * clients), error=str(e))
                raw = {"clients": clients, "error": str(e)}
            points.append(point)
            raws.append(raw)
    except (KeyboardInterrupt, Interrupted) as e:
        status = 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
        say("interrupted; every started process was stopped")
    finally:
        if not args.keep_logs and not any(p.error for p in points) and status == 0:
            for f in log_dir.iterdir():
                f.unlink()
            log_dir.rmdir()
        else:
            say(f"logs kept in {log_dir}")
    if not points:
        return status or 1
    say(f"sweep took {time.monotonic() - t0:.0f} s")
    meta = {
        "command": command,
        "when": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_state(),
    }
    write_outputs(args, points, raws, meta, partial=bool(status))
    if status:
        return status
    return 0 if all(p.error is None for p in points) else 1


def write_outputs(
    args: argparse.Namespace,
    points: Sequence[Point],
    raws: Sequence[dict[str, Any]],
    meta: dict[str, str],
    partial: bool = False,
) -> None:
    """Markdown, JSON and plots under ``args.out_dir``; the Markdown also goes to stdout."""
    prefix = Path(args.out_dir) / args.name
    title = (
        f"trioserve + mock engine ({args.step_interval_us / 1000:g} ms step), "
        f"API server on cpu {args.server_cpu}, "
        f"load generator on cpu {args.client_cpu}; {args.input_len} in / {args.output_len} out tokens"
    )
    plots = [] if args.no_plots else plot(points, args.step_interval_us, prefix, title)
    md = report(args, points, meta, plots, partial)
    prefix.with_suffix(".md").write_text(md)
    payload = {
        **meta,
        "partial": partial,
        "args": vars(args),
        "points": [asdict(p) for p in points],
        "raw": list(raws),
    }
    prefix.with_suffix(".json").write_text(json.dumps(_jsonable(payload), indent=1, allow_nan=False))
    print(md)
    say(
        f"wrote {prefix.with_suffix('.md')}, {prefix.with_suffix('.json')}" + "".join(f", {p}" for p in plots)
    )


def report_only(path: Path) -> int:
    """Rebuild the tables and plots of a saved sweep (its JSON) without measuring anything."""
    payload = json.loads(path.read_text())
    args = argparse.Namespace(**payload["args"])
    args.out_dir, args.name = str(path.parent), path.stem
    points: list[Point] = []
    for raw in payload["raw"]:
        if "result" not in raw:
            points.append(Point(raw["clients"], raw.get("num_prompts", 0), error=raw.get("error") or "error"))
            continue
        metrics = [(m["t"], {k: v for k, v in m.items() if k != "t"}) for m in raw.get("metrics", [])]
        points.append(
            make_point(
                raw["clients"],
                raw["num_prompts"],
                raw["result"],
                metrics,
                server_cpus=raw.get("server_cpus", []),
                engine_cpus=raw.get("engine_cpus", []),
                client_cpus=raw.get("client_cpus", []),
            )
        )
    meta = {k: str(payload.get(k, "unknown")) for k in ("command", "when", "machine", "git")}
    write_outputs(args, points, payload["raw"], meta, partial=bool(payload.get("partial")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
