"""vLLM and trioserve side by side on the same model folder and the same load points (issue 6, item 5).

One run serves the model folder with vLLM's CPU build (installed by ``bench/peers/install_vllm.sh``),
runs every load point against it with ``sse_loadgen.py``, stops it, then does the same with trioserve,
and prints per server and load point: API-server CPU µs per token (``/proc/PID/stat`` utime+stime of the
API-server process over the steady-state window / tokens the clients received in it), tokens/s, TTFT p50,
TPOT and tokens per SSE event (exact: both servers honour ``return_token_ids``; events that carry no ids
are counted and reported).

    bash bench/peers/install_vllm.sh
    .venv/bin/python bench/peers/tiny_model.py /tmp/tiny-smollm2
    .venv/bin/python bench/peer_compare.py /tmp/tiny-smollm2 --clients 32,128 --duration 10

``--trioserve-engine mock`` (default) runs trioserve's mock engine with the folder's tokenizer and
vocabulary, on a step clock equal to vLLM's measured decode step (TPOT) at the same load point, so both
servers stream at the same rate and the API servers do comparable work; ``--trioserve-engine model``
serves the folder itself (``python -m trioserve serve DIR``).

Core budget (2 cores): vLLM runs its model on one thread bound to ``--model-cpu`` (0;
``VLLM_CPU_OMP_THREADS_BIND``), and its API server and EngineCore on ``--api-cpu`` (1). trioserve gets
the same: API server and engine core on ``--api-cpu``; in model mode its worker process on
``--model-cpu`` with one torch thread. The load generator runs on ``--client-cpu`` (0, beside the model
thread; at these rates it needs a few % of a core). Every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend_cost import (
    Interrupted,
    Proc,
    _raise_interrupted,
    _start_ticks,
    cmdline,
    descendants,
    free_port,
    managed,
    peak_rss_mib,
    raise_nofile_limit,
    served_model,
    wait_healthy,
)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_VLLM_VENV = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trioserve/peers/vllm-0.32.0-cpu"
)
# trioserve flags this script passes; checked against `python -m trioserve serve --help` at start-up
# (model-mode flags come with the model runner: missing ones are left out and named in the output).
TRIOSERVE_FLAGS_MOCK = (
    "--engine",
    "--host",
    "--port",
    "--tokenizer",
    "--served-model-name",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--vocab-size",
    "--step-interval-us",
)
TRIOSERVE_FLAGS_MODEL_OPTIONAL = ("--device", "--dtype", "--worker-threads")


# ------------------------------------------------------------------------------------- processes


def spawn_env(name: str, argv: list[str], cpu: int | None, log_dir: Path, env: dict[str, str]) -> Proc:
    """Start ``argv`` in its own session with extra environment, pinned to ``cpu`` (``taskset`` execs,
    so the PID is the program's, and every thread and child inherits the pin unless it rebinds)."""
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
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Proc(name, popen.pid, _start_ticks(popen.pid), popen, log_path)


def find_child(root: int, pattern: str, timeout: float) -> int | None:
    """First descendant of ``root`` whose command line (process title) matches ``pattern``."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while True:
        for pid in descendants(root):
            if rx.search(cmdline(pid)):
                return pid
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def affinity(pid: int) -> list[int]:
    """Union of the CPU masks of all threads of ``pid``."""
    cpus: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                cpus |= os.sched_getaffinity(int(tid))
    return sorted(cpus)


def pin_all_threads(pid: int, cpu: int) -> None:
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {cpu})


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


# ------------------------------------------------------------------------------------------ servers


@dataclass
class Server:
    """A started server: its processes by role (api, engine, worker) and where each runs."""

    label: str
    port: int
    api: Proc
    roles: dict[str, int] = field(default_factory=dict)
    layout: str = ""
    startup_s: float = math.nan
    note: str = ""


def vllm_tmp_files() -> set[str]:
    tmp = Path(tempfile.gettempdir())
    return {p.name for p in tmp.glob("vllm_dist_*")}


def start_vllm(args: argparse.Namespace, procs: list[Proc], log_dir: Path, tag: str) -> Server:
    venv = Path(args.vllm_venv)
    exe = venv / "bin" / "vllm"
    if not exe.exists():
        raise RuntimeError(f"{exe} not found: run bench/peers/install_vllm.sh first")
    port = free_port()
    argv = [str(exe), "serve", args.model_dir, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--max-model-len", str(args.max_model_len), "--enforce-eager"]
    argv += ["--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.dtype != "auto":
        argv += ["--dtype", args.dtype]
    argv += args.vllm_arg
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib),
        # The model on one thread, bound to --model-cpu (vLLM's default binds core 0 and leaves the
        # rest to the API server and EngineCore; explicit here because the API server is pinned).
        "VLLM_CPU_OMP_THREADS_BIND": str(args.model_cpu),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    t0 = time.monotonic()
    api = spawn_env(f"{tag}-vllm", argv, args.api_cpu, log_dir, env)
    procs.append(api)
    print(f"[peer] vLLM: pid {api.pid} on cpu {args.api_cpu}, port {port}: {' '.join(argv)}", file=sys.stderr)
    wait_healthy(api, port, args.startup_timeout)
    server = Server("vLLM 0.32.0 (CPU)", port, api, startup_s=time.monotonic() - t0)
    server.roles["api"] = api.pid
    engine = find_child(api.pid, r"VLLM::EngineCore|EngineCore", 10.0)
    if engine is not None:
        server.roles["engine"] = engine
        procs.insert(0, Proc("vllm-engine", engine, _start_ticks(engine)))
        worker = find_child(engine, r"VLLM::Worker|Worker", 10.0)
        if worker is not None:
            server.roles["worker"] = worker
            procs.insert(0, Proc("vllm-worker", worker, _start_ticks(worker)))
    server.layout = describe_layout(server)
    return server


def trioserve_help() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "trioserve", "serve", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def model_config(model_dir: str) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg


def start_trioserve(
    args: argparse.Namespace, procs: list[Proc], log_dir: Path, tag: str, step_us: int | None
) -> Server:
    port = free_port()
    py = sys.executable
    argv = [py, "-m", "trioserve", "serve"]
    dropped: list[str] = []
    if args.trioserve_engine == "mock":
        vocab = int(model_config(args.model_dir)["vocab_size"])
        argv += ["--engine", "mock", "--tokenizer", args.model_dir, "--vocab-size", str(vocab)]
        argv += ["--step-interval-us", str(step_us or 0)]
        argv += ["--served-model-name", Path(args.model_dir).name]
    else:
        argv += [args.model_dir, "--engine", "model"]
        help_text = trioserve_help()
        optional = {"--device": "cpu", "--dtype": args.dtype, "--worker-threads": "1"}
        for flag, value in optional.items():
            if flag == "--dtype" and value == "auto":
                continue
            if flag in help_text:
                argv += [flag, value]
            else:
                dropped.append(flag)
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len)]
    argv += ["--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), *args.trioserve_arg]
    t0 = time.monotonic()
    api = spawn_env(f"{tag}-trioserve", argv, args.api_cpu, log_dir, {"HF_HUB_OFFLINE": "1"})
    procs.append(api)
    print(
        f"[peer] trioserve: pid {api.pid} on cpu {args.api_cpu}, port {port}: {' '.join(argv)}",
        file=sys.stderr,
    )
    wait_healthy(api, port, args.startup_timeout)
    label = "trioserve (mock engine)" if args.trioserve_engine == "mock" else "trioserve (model)"
    server = Server(label, port, api, startup_s=time.monotonic() - t0)
    server.roles["api"] = api.pid
    engine = find_child(api.pid, r"EngineCore", 10.0)
    if engine is not None:
        server.roles["engine"] = engine
        procs.insert(0, Proc("trioserve-engine", engine, _start_ticks(engine)))
        if args.trioserve_engine == "model":
            worker = find_child(engine, r"Worker|worker", 10.0) or find_child(engine, r".", 1.0)
            if worker is not None:
                server.roles["worker"] = worker
                procs.insert(0, Proc("trioserve-worker", worker, _start_ticks(worker)))
                pin_all_threads(worker, args.model_cpu)
    if dropped:
        server.note = f"not in this trioserve's --help, left out: {' '.join(dropped)}"
    server.layout = describe_layout(server)
    return server


def describe_layout(server: Server) -> str:
    parts = []
    for role, pid in server.roles.items():
        parts.append(f"{role} pid {pid} cpus {','.join(map(str, affinity(pid)))} ({threads(pid)} threads)")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------- load


@dataclass
class Point:
    server: str
    clients: int
    result: dict[str, Any] | None
    error: str | None = None
    step_us: int | None = None  # trioserve mock: the step clock it ran on
    layout: str = ""
    api_rss_mib: float = math.nan


def run_load(args: argparse.Namespace, server: Server, clients: int, log_dir: Path, tag: str) -> Point:
    result_path = log_dir / f"{tag}-result.json"
    py = sys.executable
    model = served_model(server.port)
    lg = [py, str(BENCH_DIR / "sse_loadgen.py"), "--port", str(server.port), "--model", model]
    lg += ["--clients", str(clients), "--output-len", str(args.output_len)]
    lg += ["--input-words", str(args.input_words), "--ramp", str(args.ramp)]
    lg += ["--warmup", str(args.warmup), "--duration", str(args.duration), "--grace", str(args.grace)]
    lg += ["--result-file", str(result_path), "--cpu", str(args.client_cpu)]
    for role, pid in server.roles.items():
        lg += ["--watch", f"{role}={pid}"]
    print(f"[peer] {server.label}: {clients} clients", file=sys.stderr)
    with managed([]) as procs:
        loadgen = spawn_env(f"{tag}-loadgen", lg, None, log_dir, {})
        procs.append(loadgen)
        limit = args.warmup + 30 + args.duration + args.grace + 60
        assert loadgen.popen is not None
        try:
            rc = loadgen.popen.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return Point(server.label, clients, None, f"load generator still running after {limit:.0f}s")
    if rc != 0 or not result_path.exists():
        return Point(server.label, clients, None, f"load generator failed (rc {rc}):\n{loadgen.log_tail()}")
    result = json.loads(result_path.read_bytes())
    err = None if server.api.alive() else f"server died during the run:\n{server.api.log_tail()}"
    return Point(
        server.label,
        clients,
        result,
        err,
        layout=describe_layout(server),
        api_rss_mib=peak_rss_mib(server.api.pid),
    )


def decode_step_us(p: Point) -> int | None:
    """vLLM's decode step at this load point: mean TPOT of the requests completed in the window, else
    the mean time between a client's tokens (window x clients in flight / tokens)."""
    r = p.result
    if r is None or not r.get("tokens"):
        return None
    tpot = r.get("tpot_mean_ms")
    if isinstance(tpot, (int, float)) and math.isfinite(tpot) and tpot > 0:
        return round(tpot * 1000)
    inflight = r.get("inflight_mean") or p.clients
    return round(r["window_s"] * inflight / r["tokens"] * 1e6)


# ---------------------------------------------------------------------------------------- reporting


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None else math.nan


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.{digits}f}"


def failures(r: dict[str, Any]) -> str:
    n = sum(r.get("failures_window", {}).values()) + r.get("wrong_length", 0) + r.get("bad_events", 0)
    n += sum(r.get("rejected_window", {}).values())
    return str(n)


def other_load(r: dict[str, Any], cores: dict[str, int]) -> str:
    """Busy time of each core not charged to the processes pinned there (``cores``: role -> cpu), in
    cores; includes unattributed kernel time (loopback softirq), so small values are normal."""
    busy = {int(k): v for k, v in r.get("cpu_busy_s", {}).items()}
    ours = dict.fromkeys(busy, 0.0)
    spent = {**r.get("cpu_s", {}), "client": r.get("client_cpu_s", 0.0)}
    for role, secs in spent.items():
        cpu = cores.get(role)
        if cpu in ours:
            ours[cpu] += secs
    w = r["window_s"]
    return "/".join(_f((busy[c] - ours[c]) / w, 2) for c in sorted(busy))


def table(points: list[Point], cores: dict[str, int]) -> str:
    head = [
        "server",
        "clients",
        "API CPU µs/token",
        "API cores",
        "engine cores",
        "worker cores",
        "tokens/s",
        "TTFT p50 ms",
        "TPOT ms",
        "tokens/event",
        "events w/o ids",
        "mock step µs",
        "failures",
        "API peak RSS MiB",
        "client cores",
        "other load per cpu",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        r = p.result
        if r is None:
            lines.append(
                "| " + " | ".join([p.server, str(p.clients), "error", *[""] * (len(head) - 3)]) + " |"
            )
            continue
        w = r["window_s"]
        toks = r["tokens"]
        cpu = r.get("cpu_s", {})
        api = _num(cpu.get("api"))
        other = other_load(r, cores)
        cells = [
            p.server,
            str(p.clients),
            _f(api * 1e6 / toks if toks else math.nan),
            _f(api / w, 2),
            _f(_num(cpu.get("engine")) / w, 2),
            _f(_num(cpu.get("worker")) / w, 2),
            _f(toks / w, 0),
            _f(_num(r.get("ttft_p50_ms"))),
            _f(_num(r.get("tpot_mean_ms")), 1),
            _f(toks / r["token_events"] if r.get("token_events") else math.nan, 2),
            str(r.get("no_token_ids_events", "n/a")),
            str(p.step_us) if p.step_us is not None else "",
            failures(r),
            _f(p.api_rss_mib, 0),
            _f(r.get("client_cpu_s", math.nan) / w, 2),
            other,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="vLLM (CPU) and trioserve side by side on one model folder",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("model_dir", help="Hugging Face model folder (bench/peers/tiny_model.py makes one)")
    ap.add_argument("--clients", default="32,128", help="load points: concurrent closed-loop clients")
    ap.add_argument("--output-len", type=int, default=128, help="max_tokens per request (ignore_eos)")
    ap.add_argument("--input-words", type=int, default=85, help="words per prompt")
    ap.add_argument("--duration", type=float, default=10.0, help="measurement window per point, s")
    ap.add_argument("--ramp", type=float, default=2.0, help="stagger connection starts over this many s")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the window (default ramp+3)")
    ap.add_argument("--grace", type=float, default=10.0, help="max wait for in-window TTFTs")
    ap.add_argument(
        "--servers", default="vllm,trioserve", help="which servers, in order (vllm first: mock steps need it)"
    )
    ap.add_argument("--trioserve-engine", choices=("mock", "model"), default="mock")
    ap.add_argument(
        "--step-interval-us",
        type=int,
        default=None,
        help="mock engine step; default: vLLM's measured decode step (TPOT) at the same load point",
    )
    ap.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV))
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra argument for vllm serve")
    ap.add_argument("--trioserve-arg", action="append", default=[], help="extra argument for trioserve serve")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="model dtype for both servers (vLLM's CPU build turns float32 configs into bfloat16 under "
        "'auto', and bfloat16 is emulated on CPUs without AVX512-BF16: ~2x slower steps); 'auto' passes none",
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="both servers (vLLM's CPU serve default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="both (vLLM's CPU default)")
    ap.add_argument("--api-cpu", type=int, default=1, help="API server and engine core, both servers")
    ap.add_argument("--model-cpu", type=int, default=0, help="the model's one thread (vLLM worker)")
    ap.add_argument("--client-cpu", type=int, default=0, help="the load generator")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="also write all results as JSON here")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.ramp + 3.0
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in servers:
        if s not in ("vllm", "trioserve"):
            ap.error(f"--servers: unknown {s!r}")
    if not (Path(args.model_dir) / "config.json").exists():
        ap.error(f"{args.model_dir}: no config.json")
    args.model_dir = str(Path(args.model_dir).resolve())
    usable = os.sched_getaffinity(0)
    for opt in ("api_cpu", "model_cpu", "client_cpu"):
        if getattr(args, opt) not in usable:
            ap.error(f"--{opt.replace('_', '-')}: not among the usable CPUs {sorted(usable)}")
    if args.trioserve_engine == "mock":
        missing = [f for f in TRIOSERVE_FLAGS_MOCK if f not in trioserve_help()]
        if missing:
            ap.error(f"trioserve serve lacks {' '.join(missing)}")

    raise_nofile_limit()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGHUP, _raise_interrupted)
    log_dir = Path(tempfile.mkdtemp(prefix="peer_compare."))
    points: list[Point] = []
    servers_seen: list[Server] = []
    vllm_steps: dict[int, int] = {}
    status = 0
    tmp_before = vllm_tmp_files()
    try:
        for name in servers:
            if name == "vllm":
                with managed([]) as procs:
                    srv = start_vllm(args, procs, log_dir, "vllm")
                    servers_seen.append(srv)
                    print(f"[peer] vLLM up in {srv.startup_s:.0f}s: {srv.layout}", file=sys.stderr)
                    for n in clients:
                        p = run_load(args, srv, n, log_dir, f"vllm-{n}")
                        points.append(p)
                        step = decode_step_us(p)
                        if step is not None:
                            vllm_steps[n] = step
                        if p.error:
                            print(f"[peer] {p.error}", file=sys.stderr)
                            break
            elif args.trioserve_engine == "model":
                with managed([]) as procs:
                    srv = start_trioserve(args, procs, log_dir, "trioserve", None)
                    servers_seen.append(srv)
                    for n in clients:
                        p = run_load(args, srv, n, log_dir, f"trioserve-{n}")
                        points.append(p)
                        if p.error:
                            break
            else:
                for n in clients:
                    step = args.step_interval_us or vllm_steps.get(n)
                    if step is None:
                        points.append(
                            Point(
                                "trioserve (mock engine)",
                                n,
                                None,
                                "no step interval: vLLM's point failed and --step-interval-us is not set",
                            )
                        )
                        continue
                    with managed([]) as procs:
                        srv = start_trioserve(args, procs, log_dir, f"trioserve-{n}", step)
                        servers_seen.append(srv)
                        p = run_load(args, srv, n, log_dir, f"trioserve-{n}")
                        p.step_us = step
                        points.append(p)
    except (KeyboardInterrupt, Interrupted) as e:
        status = 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
        print("[peer] interrupted; every started process was stopped", file=sys.stderr)
    except RuntimeError as e:
        print(f"[peer] {e}", file=sys.stderr)
        status = 1
    finally:
        # vLLM leaves a vllm_dist_<uuid> file in the temp folder per run: remove the ones made now.
        for name in vllm_tmp_files() - tmp_before:
            with contextlib.suppress(OSError):
                (Path(tempfile.gettempdir()) / name).unlink()
        keep = args.keep_logs or status != 0 or any(p.error for p in points)
        if keep:
            print(f"[peer] logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)

    cfg = model_config(args.model_dir)
    print()
    print(
        f"Model {args.model_dir} ({cfg.get('model_type')}, vocab {cfg.get('vocab_size')}, hidden "
        f"{cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers), dtype {args.dtype}. Closed loop: "
        f"{args.output_len} output tokens per request (ignore_eos, return_token_ids), "
        f"{args.input_words}-word chat prompts, window {args.duration:g} s; "
        f"max-num-seqs {args.max_num_seqs}, max-num-batched-tokens "
        f"{args.max_num_batched_tokens} on both servers."
    )
    print(
        f"Cores: API server + engine core on cpu {args.api_cpu} for both servers; vLLM's model worker "
        f"(1 OMP thread) on cpu {args.model_cpu}"
        + (
            f", trioserve's worker (1 torch thread) on cpu {args.model_cpu}"
            if args.trioserve_engine == "model"
            else ""
        )
        + f"; load generator on cpu {args.client_cpu}."
    )
    if args.trioserve_engine == "mock":
        print(
            "trioserve ran its mock engine (--trioserve-engine mock: no model) with the folder's tokenizer "
            "and vocabulary, on a step clock equal to vLLM's measured TPOT at the same load point "
            "(column 'mock step µs'); its engine core shares the API server's core."
        )
    print()
    shown: set[str] = set()
    for srv in servers_seen:
        if srv.label not in shown:
            shown.add(srv.label)
            note = f"; {srv.note}" if srv.note else ""
            print(f"- {srv.label}: up in {srv.startup_s:.0f} s; {srv.layout}{note}")
    print()
    cores = {"api": args.api_cpu, "engine": args.api_cpu, "worker": args.model_cpu, "client": args.client_cpu}
    print(table(points, cores))
    notes = [f"- {p.server} @ {p.clients}: {p.error}" for p in points if p.error]
    for p in points:
        r = p.result
        if r is None:
            continue
        if r.get("no_token_ids_events"):
            notes.append(
                f"- {p.server} @ {p.clients}: {r['no_token_ids_events']} token events without token_ids "
                "(counted as one token each)"
            )
        if r.get("error_samples"):
            notes.append(f"- {p.server} @ {p.clients}: first errors: " + " | ".join(r["error_samples"][:3]))
        if not r.get("ttft_samples"):
            notes.append(
                f"- {p.server} @ {p.clients}: no request started inside the window, so no TTFT (and no "
                "TPOT without completions): lengthen --duration or shorten --output-len"
            )
        if r.get("inflight_min", p.clients) < 0.95 * p.clients:
            notes.append(
                f"- {p.server} @ {p.clients}: only {r.get('inflight_min')} requests in flight at times"
            )
    if notes:
        print()
        print("\n".join(notes))
    print(
        "\n'other load per cpu' is busy time on each core not charged to the processes pinned there, "
        "in cores (includes loopback kernel work): on a shared machine, rows with large values are noisy."
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "server": p.server,
                        "clients": p.clients,
                        "error": p.error,
                        "step_us": p.step_us,
                        "layout": p.layout,
                        "api_peak_rss_mib": p.api_rss_mib,
                        "result": p.result,
                    }
                    for p in points
                ],
                indent=1,
            )
        )
    if status:
        return status
    return 0 if points and all(p.result is not None and p.error is None for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
