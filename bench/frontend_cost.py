"""API-server CPU per streamed token, against the mock engine (design §6, §12).

Starts ``python -m trioserve serve --engine mock`` pinned to one core, finds its EngineCore child, drives
it with the closed-loop load generator (``sse_loadgen.py``, pinned to another core), and reports the API
server's CPU time per streamed token over a steady-state window, with throughput, TTFT, tokens per SSE
event, failures and the engine's and client's CPU. ``--baseline`` also runs the same load against a
trivial trio SSE server (``trivial_sse_server.py``) so the load generator's own ceiling is visible.

    python bench/frontend_cost.py --clients 256 --output-len 256 --duration 10 --baseline
    python bench/frontend_cost.py --clients 64,256,512 --baseline-only --step-interval-us 2000

Every process it starts is stopped by PID on exit (SIGTERM, then SIGKILL), also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import msgspec

from loadgen_report import LoadResult, proc_stat_fields
from loadgen_wire import HIST_MAX

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TARGET_US_PER_TOKEN = 25.0


# ------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A process this script is responsible for stopping."""

    name: str
    pid: int
    start_ticks: int  # /proc/PID/stat starttime: guards against signalling a reused PID
    popen: subprocess.Popen[bytes] | None = None  # set for our direct children
    log_path: Path | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        fields = proc_stat_fields(self.pid)
        return fields is not None and fields[0] not in ("Z", "X") and int(fields[19]) == self.start_ticks

    def signal(self, sig: signal.Signals) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return True
            time.sleep(0.05)
        return not self.alive()

    def stop(self, grace: float = 5.0) -> None:
        if not self.alive():
            return
        self.signal(signal.SIGTERM)
        if not self.wait(grace):
            print(f"[bench] {self.name} (pid {self.pid}) ignored SIGTERM; killing", file=sys.stderr)
            self.signal(signal.SIGKILL)
            self.wait(2.0)

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set size (``VmHWM`` in /proc/PID/status), MiB; nan if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return math.nan


def _start_ticks(pid: int) -> int:
    fields = proc_stat_fields(pid)
    return int(fields[19]) if fields is not None else -1


def raise_nofile_limit() -> None:
    """Children inherit it: 1024 clients need more than the usual 1024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def spawn(name: str, argv: list[str], cpu: int | None, log_dir: Path, nice: int = 0) -> Proc:
    """Start ``argv`` in its own session, pinned to ``cpu`` from before exec (``taskset`` and ``nice``
    exec, so the PID is the program's; pin and priority are inherited by every thread and child)."""
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    if cpu is not None:
        taskset = shutil.which("taskset")
        if taskset is None:
            raise RuntimeError("taskset (util-linux) is needed to pin processes")
        argv = [taskset, "-c", str(cpu), *argv]
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop them in order
        )
    return Proc(name, popen.pid, _start_ticks(popen.pid), popen, log_path)


def descendants(root: int) -> list[int]:
    """PIDs of all live descendants of ``root``, found by walking /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = proc_stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def find_engine(server_pid: int, timeout: float = 5.0) -> int | None:
    """The EngineCore process under the API server: by title, else the only child."""
    deadline = time.monotonic() + timeout
    while True:
        pids = descendants(server_pid)
        titled = [p for p in pids if "EngineCore" in cmdline(p)]
        if titled:
            return titled[0]
        if time.monotonic() >= deadline:
            direct = [p for p in pids if "resource_tracker" not in cmdline(p)]
            return direct[0] if len(direct) == 1 else None
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as e:
        return int(e.code), b""


def wait_healthy(proc: Proc, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
        with contextlib.suppress(OSError):
            if http_get(f"http://127.0.0.1:{port}/health", timeout=1.0)[0] == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not healthy after {timeout:.0f}s:\n{proc.log_tail()}")


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model] = []


def served_model(port: int) -> str:
    with contextlib.suppress(OSError, msgspec.DecodeError):
        status, body = http_get(f"http://127.0.0.1:{port}/v1/models")
        if status == 200:
            models = msgspec.json.decode(body, type=_Models).data
            if models:
                return models[0].id
    return "mock"


class Interrupted(BaseException):
    """SIGTERM / SIGHUP: unwind like Ctrl-C so that every started process is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


# ------------------------------------------------------------------------------------------ one run


@dataclass
class Row:
    label: str
    clients: int
    result: LoadResult | None
    error: str | None = None
    engine_found: bool = False
    server_cpu: int | None = None
    client_cpu: int | None = None
    engine_cpus: tuple[int, ...] = ()
    tokens_per_step: int = 1
    server_peak_rss_mib: float = math.nan  # API server's VmHWM at the end of the run


@contextlib.contextmanager
def managed(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every registered process, newest first, however the block exits."""
    try:
        yield procs
    finally:
        for p in reversed(procs):
            try:
                p.stop()
            except Exception as e:  # keep stopping the others
                print(f"[bench] stopping {p.name} (pid {p.pid}): {e}", file=sys.stderr)


_run_ids = itertools.count(1)


def run_point(args: argparse.Namespace, kind: str, clients: int, log_dir: Path) -> Row:
    port = free_port()
    tag = f"{next(_run_ids):02d}-{kind}-{clients}"
    py = sys.executable
    label = {"baseline": "trivial baseline", "pooled": "trioserve, models listed first"}.get(
        kind, "trioserve"
    )
    with managed([]) as procs:
        if kind == "baseline":
            argv = [py, str(BENCH_DIR / "trivial_sse_server.py"), "--port", str(port)]
            argv += ["--step-interval-us", str(args.step_interval_us)]
            argv += ["--tokens-per-event", str(args.baseline_tokens_per_event)]
        else:
            argv = [py, "-m", "trioserve", "serve", "--engine", "mock"]
            argv += ["--step-interval-us", str(args.step_interval_us), "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--max-num-seqs", str(args.max_num_seqs), *args.server_arg]
        server = spawn(f"{tag}-server", argv, args.server_cpu, log_dir, args.nice)
        procs.append(server)
        print(f"[bench] {label}: pid {server.pid} on cpu {args.server_cpu}, port {port}", file=sys.stderr)
        wait_healthy(server, port, args.startup_timeout)
        watch = {"server": server.pid}
        engine_pid: int | None = None
        engine_cpus: tuple[int, ...] = ()
        if kind != "baseline":
            engine_pid = find_engine(server.pid)
            if engine_pid is None:
                print("[bench] EngineCore child not found; engine CPU not reported", file=sys.stderr)
            else:
                procs.insert(0, Proc("engine", engine_pid, _start_ticks(engine_pid)))
                watch["engine"] = engine_pid
                if args.engine_cpu is not None:
                    for tid in os.listdir(f"/proc/{engine_pid}/task"):
                        with contextlib.suppress(OSError):
                            os.sched_setaffinity(int(tid), {args.engine_cpu})
                engine_cpus = tuple(sorted(os.sched_getaffinity(engine_pid)))
                print(f"[bench] engine: pid {engine_pid} on cpus {list(engine_cpus)}", file=sys.stderr)
        model = args.model or served_model(port)
        result_path = log_dir / f"{tag}-result.json"
        lg = [py, str(BENCH_DIR / "sse_loadgen.py"), "--port", str(port), "--model", model]
        lg += ["--clients", str(clients), "--output-len", str(args.output_len)]
        lg += ["--input-words", str(args.input_words), "--ramp", str(args.ramp)]
        lg += ["--warmup", str(args.warmup), "--duration", str(args.duration)]
        lg += ["--result-file", str(result_path), "--io", args.client_io]
        if kind == "pooled":
            lg += ["--list-models-first"]
        if args.logprobs is not None and kind != "baseline":
            lg += ["--logprobs", str(args.logprobs)]
        for name, pid in watch.items():
            lg += ["--watch", f"{name}={pid}"]
        loadgen = spawn(f"{tag}-loadgen", lg, args.client_cpu, log_dir, args.nice)
        procs.append(loadgen)
        limit = args.warmup + 30 + args.duration + 15 + 30
        assert loadgen.popen is not None
        try:
            rc = loadgen.popen.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return Row(label, clients, None, f"load generator still running after {limit:.0f}s")
        if rc != 0 or not result_path.exists():
            return Row(label, clients, None, f"load generator failed (rc {rc}):\n{loadgen.log_tail()}")
        rss = peak_rss_mib(server.pid) if server.alive() else math.nan
        result = msgspec.json.decode(result_path.read_bytes(), type=LoadResult)
        err = None if server.alive() else f"server died during the run:\n{server.log_tail()}"
        return Row(
            label,
            clients,
            result,
            err,
            engine_found=engine_pid is not None,
            server_cpu=args.server_cpu,
            client_cpu=args.client_cpu,
            engine_cpus=engine_cpus,
            tokens_per_step=args.baseline_tokens_per_event if kind == "baseline" else 1,
            server_peak_rss_mib=rss,
        )


# ---------------------------------------------------------------------------------------- reporting


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.{digits}f}"


def _failures(r: LoadResult) -> str:
    n = sum(r.failures_window.values()) + r.wrong_length + r.bad_events
    if not n:
        return "0"
    parts = [f"{k} {v}" for k, v in sorted(r.failures_window.items())]
    if r.wrong_length:
        parts.append(f"short {r.wrong_length}")
    if r.bad_events:
        parts.append(f"bad events {r.bad_events}")
    return f"{n} ({', '.join(parts)})"


def rejected(r: LoadResult) -> str:
    """Requests refused with 429/503 in the window (not failures: the client backed off and retried)."""
    n = sum(r.rejected_window.values())
    if not n:
        return "0"
    return f"{n} ({', '.join(f'{k} {v}' for k, v in sorted(r.rejected_window.items()))})"


def other_load(row: Row) -> tuple[float, float]:
    """Busy time on the server's and the client's core not spent in our processes, in cores.

    Includes kernel time not charged to any process (loopback softirq of our own traffic, counted in
    /proc/stat but not in /proc/PID/stat), so a small value is normal; a large one means something else
    ran on the pinned core and the figures are suspect.
    """
    r = row.result
    if r is None:
        return math.nan, math.nan
    w = r.window_s
    on_server_core = r.cpu_s.get("server", 0.0)
    if row.engine_cpus == (row.server_cpu,):
        on_server_core += r.cpu_s.get("engine", 0.0)
    out = []
    for cpu, ours in ((row.server_cpu, on_server_core), (row.client_cpu, r.client_cpu_s)):
        busy = r.cpu_busy_s.get(cpu, math.nan) if cpu is not None else math.nan
        out.append((busy - ours) / w)
    return out[0], out[1]


def table(rows: list[Row], step_interval_us: int) -> str:
    head = [
        "server",
        "clients",
        "API CPU µs/token",
        "API cores",
        "tokens/s",
        "expected tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT ms",
        "tokens/event",
        "rejected",
        "failures",
        "API peak RSS MiB",
        "engine cores",
        "client cores",
        "client µs/event",
        "min in flight",
        "other load srv/cli core",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row.result
        if r is None:
            cells = [row.label, str(row.clients), "error", *[""] * (len(head) - 3)]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        w = r.window_s
        toks = r.tokens
        api = r.cpu_s.get("server", math.nan)
        eng = r.cpu_s.get("engine", math.nan)
        cells = [
            row.label,
            str(row.clients),
            _f(api * 1e6 / toks if toks else math.nan),
            _f(api / w, 2),
            _f(toks / w, 0),
            _f(row.clients * row.tokens_per_step * 1e6 / step_interval_us, 0),
            _f(r.ttft_p50_ms),
            _f(r.ttft_p99_ms),
            _f(r.tpot_mean_ms, 2),
            _f(toks / r.token_events if r.token_events else math.nan, 2),
            rejected(r),
            _failures(r),
            _f(row.server_peak_rss_mib, 0),
            _f(eng / w, 2) if row.engine_found else "n/a",
            _f(r.client_cpu_s / w, 2),
            _f(r.client_cpu_s * 1e6 / r.sse_events if r.sse_events else math.nan),
            f"{r.inflight_min}/{r.clients}",
            "/".join(_f(x, 2) for x in other_load(row)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: list[Row]) -> list[str]:
    out: list[str] = []
    for row in rows:
        tag = f"{row.label} @ {row.clients}"
        if row.error:
            out.append(f"- {tag}: {row.error}")
        r = row.result
        if r is None:
            continue
        if row.label == "trioserve" and r.tokens:
            us = r.cpu_s.get("server", math.nan) * 1e6 / r.tokens
            tpe = r.tokens / r.token_events if r.token_events else math.nan
            verdict = "meets" if us <= TARGET_US_PER_TOKEN else "misses"
            out.append(
                f"- {tag}: {us:.1f} µs API-server CPU per token at {tpe:.2f} tokens/event; {verdict} the "
                f"≤ {TARGET_US_PER_TOKEN:g} µs target (which is set for 256 clients, 1 token/event)"
            )
        srv_other, cli_other = other_load(row)
        if srv_other > 0.2 or cli_other > 0.2:
            out.append(
                f"- {tag}: {srv_other:.2f} / {cli_other:.2f} cores of other load on the server / client "
                "core during the window (other processes, or unattributed kernel time); figures are noisy"
            )
        if r.client_cpu_s / r.window_s > 0.85:
            out.append(
                f"- {tag}: the load generator used {r.client_cpu_s / r.window_s:.2f} cores; it may be "
                "the bottleneck"
            )
        if r.tokens_per_event_hist and max(r.tokens_per_event_hist) > 1:
            hist = ", ".join(
                f"{'≥' if k == HIST_MAX else ''}{k}: {v}" for k, v in sorted(r.tokens_per_event_hist.items())
            )
            out.append(f"- {tag}: tokens per event histogram {{{hist}}}")
        if r.no_token_ids_events:
            out.append(f"- {tag}: {r.no_token_ids_events} events without token_ids (counted as 1 token)")
        if r.ttft_missing:
            out.append(f"- {tag}: {r.ttft_missing} requests sent in the window had no first token")
        if r.cpu_gone:
            out.append(f"- {tag}: process(es) gone before the window ended: {', '.join(r.cpu_gone)}")
        if r.error_samples:
            out.append(f"- {tag}: first errors: " + " | ".join(r.error_samples[:3]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="API-server CPU per streamed token against the mock engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--clients", default="256", help="concurrent closed-loop clients; a comma list sweeps")
    ap.add_argument("--output-len", type=int, default=256, help="max_tokens per request (ignore_eos)")
    ap.add_argument(
        "--input-words", type=int, default=85, help="words per prompt (85 ≈ 256 Qwen3 tokens, seed 000)"
    )
    ap.add_argument("--step-interval-us", type=int, default=10000, help="mock engine step clock")
    ap.add_argument("--duration", type=float, default=10.0, help="measurement window, seconds")
    ap.add_argument("--ramp", type=float, default=1.0, help="stagger connection starts over this many s")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the window (default ramp+2)")
    ap.add_argument("--baseline", action="store_true", help="also measure the trivial SSE server")
    ap.add_argument("--baseline-only", action="store_true", help="measure only the trivial SSE server")
    ap.add_argument("--baseline-tokens-per-event", type=int, default=1)
    ap.add_argument(
        "--pooled",
        action="store_true",
        help="also measure SDK-style pooled clients: each connection lists the models before streaming",
    )
    ap.add_argument(
        "--client-io",
        choices=("epoll", "tasks"),
        default="epoll",
        help="load generator I/O: one epoll dispatcher task, or a trio task per connection",
    )
    ap.add_argument("--server-cpu", type=int, default=0, help="core for the server (engine inherits it)")
    ap.add_argument("--client-cpu", type=int, default=1, help="core for the load generator")
    ap.add_argument("--engine-cpu", type=int, default=None, help="move the engine to this core")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for trioserve serve")
    ap.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="requests ask for logprobs (K alternatives)"
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run server and client at this nice level (e.g. -10 on a shared machine; needs root)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="measure every point this many times")
    ap.add_argument("--json", default=None, help="also write all results as JSON to this path")
    ap.add_argument("--keep-logs", action="store_true", help="keep the per-process logs directory")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.ramp + 2.0
    clients = [int(c) for c in str(args.clients).split(",") if c.strip()]
    cpus = os.sched_getaffinity(0)
    for opt in ("server_cpu", "client_cpu", "engine_cpu"):
        cpu = getattr(args, opt)
        if cpu is not None and cpu not in cpus:
            ap.error(f"--{opt.replace('_', '-')} {cpu}: not among the usable CPUs {sorted(cpus)}")
    if args.server_cpu == args.client_cpu:
        print("[bench] warning: server and client share a core", file=sys.stderr)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGHUP, _raise_interrupted)
    status = 0
    kinds = (
        ["baseline"]
        if args.baseline_only
        else (["baseline", "trioserve"] if args.baseline else ["trioserve"])
    )
    if args.pooled and not args.baseline_only:
        kinds.append("pooled")
    log_dir = Path(tempfile.mkdtemp(prefix="frontend_cost."))
    rows: list[Row] = []
    try:
        for n, _, kind in itertools.product(clients, range(args.repeat), kinds):
            try:
                rows.append(run_point(args, kind, n, log_dir))
            except RuntimeError as e:
                rows.append(Row(kind, n, None, str(e)))
    except (KeyboardInterrupt, Interrupted) as e:
        status = 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
        print("[bench] interrupted; every started process was stopped", file=sys.stderr)
        if not rows:
            return status
    finally:
        if not args.keep_logs and not any(r.error for r in rows):
            for f in log_dir.iterdir():
                f.unlink()
            log_dir.rmdir()
        else:
            print(f"[bench] logs kept in {log_dir}", file=sys.stderr)

    print()
    print(
        f"Closed loop, {args.output_len} output tokens per request (ignore_eos), "
        f"{args.input_words}-word prompts, engine step {args.step_interval_us} µs, window "
        f"{args.duration:g} s; server on cpu {args.server_cpu}, load generator on cpu {args.client_cpu}. "
        f"Target: ≤ {TARGET_US_PER_TOKEN:g} µs API-server CPU per token at 1 token/event, 256 clients."
    )
    print()
    print(table(rows, args.step_interval_us))
    extra = notes(rows)
    if extra:
        print()
        print("\n".join(extra))
    if args.json:
        payload = [
            {
                "server": r.label,
                "clients": r.clients,
                "error": r.error,
                "server_peak_rss_mib": None if math.isnan(r.server_peak_rss_mib) else r.server_peak_rss_mib,
                "result": r.result,
            }
            for r in rows
        ]
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(payload)))
    if status:
        return status
    return 0 if all(r.result is not None and r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
