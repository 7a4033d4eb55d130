"""Several API servers and engine cores, side by side in one run (issue 13, item 9; seed 000).

Three parts, each a set of load points against ``serve --engine mock`` with the closed-loop load
generator (``sse_loadgen.py``):

a. the frontend ceiling with ``--api-server-count 1`` and ``2`` (10 ms engine step) at 256 and 1024
   clients: tokens/s, TTFT p50, tokens per event, each API server's CPU, the engine's and the load
   generator's, and the balance (open connections and streamed tokens per API server, from
   ``/metrics``' ``trioserve:`` series, which carry ``api_server="i"``);
b. ``-dp 2`` with ``--dispatch dplb`` and ``round-robin``: per engine, the mean number of running
   requests as the engines themselves report it (read off the DP coordinator's PUB socket, the same
   ``LoadSnapshot`` the API servers follow) and each engine's CPU;
c. the connection-pool trap: a few keep-alive connections (each carrying one stream after another)
   against two API servers, placed once at accept time, versus many connections.

Pinning (2 cores): see ``LAYOUTS``. Every point reports each process's CPU from /proc, the busy time
on each core not charged to our processes ("other load"), and the load average before and after.

    python bench/scale_out.py --nice -10          # every part, about 5 minutes
    python bench/scale_out.py --parts c --duration 8

Every process it starts is stopped by PID (the supervisor: SIGTERM, and it stops its children; any
child still alive afterwards is stopped by its own PID), also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from frontend_cost import (
    Interrupted,
    Proc,
    _f,
    _raise_interrupted,
    cmdline,
    descendants,
    free_port,
    http_get,
    managed,
    raise_nofile_limit,
    served_model,
    spawn,
    wait_healthy,
)
from loadgen_report import LoadResult, proc_stat_fields
from sweep import MetricSample, counter_rate, raise_priority, warm_up, window_mean

BENCH_DIR = Path(__file__).resolve().parent

# Where each process runs, by role: a title prefix (``APIServer_0``, ``EngineCore``, ...) or "loadgen".
# Roles not named run where the tree was started ("tree"). The ceiling layout gives the first API server
# a core of its own and puts everything else on the other: with one API server that core holds the
# load generator and the engine, with two also the second API server, which gets what they leave.
LAYOUTS: dict[str, dict[str, int]] = {
    "ceiling": {"tree": 1, "APIServer": 0, "APIServer_0": 0, "loadgen": 1},
    # Balance checks (parts b and c): the whole tree on core 0, the load generator alone on core 1.
    "balance": {"tree": 0, "loadgen": 1},
}


@dataclass
class Spec:
    part: str
    label: str
    api_servers: int
    clients: int
    dp: int = 1
    dispatch: str | None = None
    step_us: int = 10000
    output_len: int = 256
    layout: str = "ceiling"
    ramp: float = 1.0
    pause_peer: bool = False  # part c: APIServer_1 is stopped (SIGSTOP) while the pool connects
    range_ratio: float = 0.0  # output lengths uniform in [len*(1-r), len*(1+r)]


@dataclass
class Outcome:
    spec: Spec
    result: LoadResult | None = None
    error: str | None = None
    procs: dict[str, int] = field(default_factory=dict)  # role -> pid
    cpus: dict[str, int] = field(default_factory=dict)  # role -> the core it was pinned to
    per_api: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> api_server -> value
    engine_running: dict[int, float] = field(default_factory=dict)  # engine -> mean running (coordinator)
    loadavg_before: str = ""
    loadavg_after: str = ""


# ------------------------------------------------------------------------------------- processes


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def title(pid: int) -> str:
    """The ``trioserve::Role`` title (setproctitle rewrites argv), or ''."""
    m = re.match(r"trioserve::(\S+)", cmdline(pid))
    return m.group(1) if m else ""


def find_roles(root: int, want: int, timeout: float = 10.0) -> dict[str, int]:
    """Every titled trioserve process in the tree under (and including) ``root``: role -> pid; waits
    until ``want`` of them are there."""
    deadline = time.monotonic() + timeout
    while True:
        roles = {t: p for p in [root, *descendants(root)] if (t := title(p))}
        if len(roles) >= want or time.monotonic() >= deadline:
            return roles
        time.sleep(0.1)


def pin(pid: int, cpu: int) -> None:
    """Move every thread of ``pid`` to ``cpu`` (threads started later inherit the main thread's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {cpu})


def as_proc(name: str, pid: int) -> Proc:
    fields = proc_stat_fields(pid)
    return Proc(name, pid, int(fields[19]) if fields is not None else -1)


@contextlib.contextmanager
def paused(pid: int | None) -> Iterator[None]:
    """SIGSTOP ``pid`` for the block (nothing when None); SIGCONT however it ends."""
    if pid is None:
        yield
        return
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# --------------------------------------------------------------------------------------- sampling

_SERIES = re.compile(
    r'^(trioserve:(?:open_connections|stream_tokens_total))\{[^}]*api_server="(\d+)"[^}]*\}\s+(\S+)'
)


def per_api_series(text: str) -> dict[str, float]:
    """``trioserve:open_connections`` and ``trioserve:stream_tokens_total`` per API server, keyed
    ``NAME|i``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m:
            out[f"{m.group(1)}|{m.group(2)}"] = float(m.group(3))
    return out


def established_inodes(port: int) -> set[int]:
    """Socket inodes of the established TCP connections whose local port is ``port`` (/proc/net/tcp)."""
    out: set[int] = set()
    with contextlib.suppress(OSError), open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[3] == "01" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                out.add(int(cols[9]))
    return out


def connections_of(pid: int, inodes: set[int]) -> int:
    """How many of ``inodes`` process ``pid`` holds open (from /proc/PID/fd; costs the server nothing,
    unlike a /metrics scrape, whose own connection would be counted on whichever server answered)."""
    n = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    n += 1
    return n


class Sampler:
    """A thread that scrapes ``/metrics`` every ``interval`` s (each scrape is answered by one API server
    with every API server's series) and counts each API server's connections from /proc; with a
    coordinator, a second thread follows its PUB socket."""

    def __init__(self, port: int, interval: float, coordinator: str | None, apis: dict[str, int]) -> None:
        self.port = port
        self.interval = interval
        self.coordinator = coordinator
        self.apis = apis  # API server index -> pid
        self.samples: list[MetricSample] = []
        self.snapshots: list[tuple[float, list[int]]] = []  # (unix time, running per engine)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._scrape, daemon=True)]
        if coordinator is not None:
            self._threads.append(threading.Thread(target=self._follow, daemon=True))

    def __enter__(self) -> Sampler:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=3.0)

    def _scrape(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):
                status, body = http_get(f"http://127.0.0.1:{self.port}/metrics", timeout=2.0)
                if status == 200:
                    series = per_api_series(body.decode(errors="replace"))
                    inodes = established_inodes(self.port)
                    for i, pid in self.apis.items():
                        series[f"connections|{i}"] = connections_of(pid, inodes)
                    self.samples.append((time.time(), series))

    def _follow(self) -> None:
        import zmq  # only part b needs it

        from trioserve.protocol.codec import ProtocolError, load_snapshot_codec

        codec = load_snapshot_codec()
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            sub.connect(str(self.coordinator))
            while not self._stop.is_set():
                try:
                    frames = sub.recv_multipart()
                except zmq.Again:
                    continue
                with contextlib.suppress(ProtocolError):
                    snap = codec.decode(frames[-1])
                    running = [0] * (1 + max((e.engine_index for e in snap.engines), default=-1))
                    for e in snap.engines:
                        running[e.engine_index] = e.num_running + e.num_waiting
                    self.snapshots.append((time.time(), running))
        finally:
            sub.close(linger=0)
            ctx.term()


def time_weighted_mean(snaps: list[tuple[float, list[int]]], t0: float, t1: float) -> dict[int, float]:
    """Per engine, the mean of its (running + waiting) count over [t0, t1]; each snapshot holds until
    the next (the coordinator publishes on change, at most every 100 ms)."""
    if not snaps:
        return {}
    n = max(len(r) for _, r in snaps)
    acc = [0.0] * n
    total = 0.0
    for i, (t, running) in enumerate(snaps):
        start = max(t, t0)
        end = min(snaps[i + 1][0] if i + 1 < len(snaps) else t1, t1)
        if end <= start:
            continue
        total += end - start
        for e, r in enumerate(running):
            acc[e] += r * (end - start)
    return {e: (a / total if total else math.nan) for e, a in enumerate(acc)}


# ------------------------------------------------------------------------------------------ a point


def run_point(args: argparse.Namespace, spec: Spec, log_dir: Path, tag: str) -> Outcome:
    out = Outcome(spec, loadavg_before=loadavg())
    layout = LAYOUTS[spec.layout]
    port = free_port()
    py = sys.executable
    argv = [py, "-m", "trioserve", "serve", "--engine", "mock", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--step-interval-us", str(spec.step_us), "--max-num-seqs", "1024"]
    argv += ["--api-server-count", str(spec.api_servers)]
    if spec.dp > 1:
        argv += ["-dp", str(spec.dp)]
    if spec.dispatch:
        argv += ["--dispatch", spec.dispatch]
    children: list[Proc] = []
    with managed([]) as procs:
        try:
            root = spawn(f"{tag}-serve", argv, layout["tree"], log_dir, args.nice)
            procs.append(root)
            raise_priority(root, args.nice)
            wait_healthy(root, port, args.startup_timeout)
            supervised = spec.api_servers > 1 or spec.dp > 1
            want = spec.api_servers + spec.dp + supervised + (spec.dp > 1)
            roles = find_roles(root.pid, want)
            out.procs = roles
            for role, pid in roles.items():
                cpu = layout.get(role, layout["tree"])
                if cpu != layout["tree"]:
                    pin(pid, cpu)
                out.cpus[role] = cpu
                if pid != root.pid:
                    children.append(as_proc(role, pid))
            model = served_model(port)
            warm_up(port, model, n=2 * spec.api_servers)
            coordinator = None
            if spec.dp > 1:
                found = glob.glob(f"/tmp/trioserve-{root.pid}-*/coordinator_out")
                coordinator = f"ipc://{found[0]}" if found else None
            result_path = log_dir / f"{tag}-result.json"
            lg = [py, str(BENCH_DIR / "sse_loadgen.py"), "--port", str(port), "--model", model]
            lg += ["--clients", str(spec.clients), "--output-len", str(spec.output_len)]
            lg += ["--input-words", "85", "--ramp", str(spec.ramp), "--warmup", str(spec.ramp + 2)]
            lg += ["--duration", str(args.duration), "--result-file", str(result_path), "--quiet"]
            lg += ["--random-range-ratio", str(spec.range_ratio)]
            for role, pid in roles.items():
                lg += ["--watch", f"{role}={pid}"]
            out.cpus["loadgen"] = layout["loadgen"]
            peer = roles.get("APIServer_1") if spec.pause_peer else None
            apis = {
                role.rsplit("_", 1)[-1] if "_" in role else "0": pid
                for role, pid in roles.items()
                if role.startswith("APIServer")
            }
            with Sampler(port, args.metrics_interval, coordinator, apis) as sampler:
                with paused(peer):
                    loadgen = spawn(f"{tag}-loadgen", lg, layout["loadgen"], log_dir, args.nice)
                    procs.append(loadgen)
                    raise_priority(loadgen, args.nice)
                    if peer is not None:
                        time.sleep(spec.ramp + 1.0)  # the pool has connected, to APIServer_0 alone
                assert loadgen.popen is not None
                limit = spec.ramp + 2 + args.duration + 60
                try:
                    rc = loadgen.popen.wait(timeout=limit)
                except Exception:
                    out.error = f"load generator still running after {limit:.0f}s"
                    return out
            if rc != 0 or not result_path.exists():
                out.error = f"load generator failed (rc {rc}):\n{loadgen.log_tail()}"
                return out
            r = msgspec.json.decode(result_path.read_bytes(), type=LoadResult)
            out.result = r
            t0, t1 = r.window_start_unix, r.window_end_unix
            for i in range(spec.api_servers):
                conns = window_mean(sampler.samples, f"connections|{i}", t0, t1)
                rate = counter_rate(sampler.samples, f"trioserve:stream_tokens_total|{i}", t0, t1)
                out.per_api.setdefault("connections", {})[str(i)] = conns
                out.per_api.setdefault("tokens_per_s", {})[str(i)] = rate
            out.engine_running = time_weighted_mean(sampler.snapshots, t0, t1)
            if not root.alive():
                out.error = f"server died during the run:\n{root.log_tail()}"
        except RuntimeError as e:
            out.error = str(e)
        finally:
            out.loadavg_after = loadavg()
            for p in procs:  # the supervisor first: SIGTERM stops its children in order
                p.stop(grace=10.0)
            for c in children:  # anything it left behind, by its own PID
                c.stop()
    return out


# ---------------------------------------------------------------------------------------- reporting


def _cores(r: LoadResult, role: str) -> float:
    return r.cpu_s.get(role, math.nan) / r.window_s


def api_roles(o: Outcome) -> list[str]:
    return sorted(role for role in o.procs if role.startswith("APIServer"))


def other_load(o: Outcome) -> dict[int, float]:
    """Per core: busy time in the window not charged to our processes (cores). As frontend_cost's
    column: includes unattributed kernel time (loopback softirq), so a small value is normal."""
    r = o.result
    if r is None:
        return {}
    ours: dict[int, float] = {}
    for role, cpu in o.cpus.items():
        cpu_s = r.client_cpu_s if role == "loadgen" else r.cpu_s.get(role, 0.0)
        ours[cpu] = ours.get(cpu, 0.0) + cpu_s
    return {cpu: (r.cpu_busy_s.get(cpu, math.nan) - ours.get(cpu, 0.0)) / r.window_s for cpu in sorted(ours)}


def _split(values: dict[str, float], digits: int = 0) -> str:
    if not values:
        return "n/a"
    return " / ".join(_f(values[k], digits) for k in sorted(values))


def _share(values: dict[str, float]) -> str:
    total = sum(v for v in values.values() if not math.isnan(v))
    if not values or not total:
        return "n/a"
    return " / ".join(f"{100 * values[k] / total:.0f}%" for k in sorted(values))


def _common(o: Outcome) -> list[str]:
    r = o.result
    assert r is not None
    toks = r.tokens
    api_cpu = sum(r.cpu_s.get(a, 0.0) for a in api_roles(o))
    return [
        _f(toks / r.window_s, 0),
        _f(r.ttft_p50_ms),
        _f(toks / r.token_events if r.token_events else math.nan, 2),
        _f(api_cpu * 1e6 / toks if toks else math.nan),
        " / ".join(_f(_cores(r, a), 2) for a in api_roles(o)),
    ]


def _load_cells(o: Outcome) -> list[str]:
    other = other_load(o)
    fails = sum(o.result.failures_window.values()) if o.result else 0
    return [
        " / ".join(f"{_f(v, 2)}" for v in other.values()),
        str(fails),
        f"{o.loadavg_before} → {o.loadavg_after}",
    ]


def table(outcomes: list[Outcome], part: str) -> str:
    rows = [o for o in outcomes if o.spec.part == part]
    head = ["point", "clients", "tokens/s", "TTFT p50 ms", "tokens/event", "API CPU µs/token", "API cores"]
    if part == "b":
        head += ["engine cores DP0 / DP1", "mean requests per engine (coordinator)", "engine share"]
    else:
        head += ["engine cores", "loadgen cores", "connections per API server", "token share per API server"]
    head += ["other load core0 / core1", "failures", "load avg before → after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in rows:
        cells = [o.spec.label, str(o.spec.clients)]
        r = o.result
        if r is None:
            lines.append("| " + " | ".join([*cells, "error", *[""] * (len(head) - 3)]) + " |")
            continue
        cells += _common(o)
        if part == "b":
            engines = sorted(role for role in o.procs if role.startswith("EngineCore"))
            cells.append(" / ".join(_f(_cores(r, e), 2) for e in engines))
            running = {str(k): v for k, v in o.engine_running.items()}
            cells += [_split(running, 1), _share(running)]
        else:
            cells.append(_f(_cores(r, "EngineCore"), 2))
            cells.append(_f(r.client_cpu_s / r.window_s, 2))
            cells.append(_split(o.per_api.get("connections", {}), 1))
            cells.append(_share(o.per_api.get("tokens_per_s", {})))
        cells += _load_cells(o)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ceiling_ratio(outcomes: list[Outcome]) -> list[str]:
    out: list[str] = []
    by = {(o.spec.api_servers, o.spec.clients): o.result for o in outcomes if o.spec.part == "a" and o.result}
    for clients in sorted({c for _, c in by}):
        one, two = by.get((1, clients)), by.get((2, clients))
        if one and two and one.tokens:
            ratio = (two.tokens / two.window_s) / (one.tokens / one.window_s)
            out.append(f"- {clients} clients: tokens/s with 2 API servers / with 1 = {ratio:.2f}")
    return out


def specs(args: argparse.Namespace) -> list[Spec]:
    out: list[Spec] = []
    if "a" in args.parts:
        for clients in args.clients:
            for n in (1, 2):
                label = f"{n} API server{'s' * (n > 1)}, layout {args.a_layout}"
                out.append(Spec("a", label, n, clients, layout=args.a_layout))
    if "b" in args.parts:
        for dispatch in ("dplb", "round-robin"):
            out.append(
                Spec(
                    "b",
                    f"-dp 2, {dispatch}, output 256 ± 90%",
                    2,
                    args.dp_clients,
                    dp=2,
                    dispatch=dispatch,
                    layout="balance",
                    range_ratio=0.9,
                )
            )
    if "c" in args.parts:
        # 1 ms steps so that a few streams carry enough per-token work to saturate one API server;
        # the ceiling layout gives each API server a core of its own to saturate.
        for pool in args.pools:
            out.append(
                Spec("c", f"pool of {pool}, both serving", 2, pool, step_us=1000, layout="ceiling", ramp=0.2)
            )
            out.append(
                Spec(
                    "c",
                    f"pool of {pool}, placed on APIServer_0",
                    2,
                    pool,
                    step_us=1000,
                    layout="ceiling",
                    ramp=0.2,
                    pause_peer=True,
                )
            )
        # The same token rate as the largest pool, spread over ten times the connections.
        many = args.many or 10 * max(args.pools)
        out.append(Spec("c", "many connections", 2, many, step_us=10000, layout="ceiling", ramp=1.0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--parts", default="abc", help="which parts to run (a, b, c)")
    ap.add_argument("--clients", default="256,1024", help="part a: closed-loop clients, comma list")
    ap.add_argument("--a-layout", choices=sorted(LAYOUTS), default="ceiling", help="part a: pinning")
    ap.add_argument("--dp-clients", type=int, default=256, help="part b: clients")
    ap.add_argument("--pools", default="16", help="part c: pool sizes (keep-alive connections), comma list")
    ap.add_argument("--many", type=int, default=0, help="part c: the many-connections point (0: 10 x pool)")
    ap.add_argument("--duration", type=float, default=10.0, help="measurement window per point, s")
    ap.add_argument("--metrics-interval", type=float, default=1.0, help="s between /metrics scrapes")
    ap.add_argument("--nice", type=int, default=0, help="nice and autogroup nice (negative needs root)")
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None, help="also write every outcome as JSON here")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.pools = [int(c) for c in args.pools.split(",") if c]
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        ap.error("needs cores 0 and 1")
    raise_nofile_limit()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGHUP, _raise_interrupted)
    log_dir = Path(tempfile.mkdtemp(prefix="scale_out."))
    outcomes: list[Outcome] = []
    status = 0
    print(f"[bench] load average at start: {loadavg()}; logs in {log_dir}", file=sys.stderr)
    try:
        for i, spec in enumerate(specs(args)):
            print(f"[bench] {spec.part}: {spec.label}, {spec.clients} clients ...", file=sys.stderr)
            o = run_point(args, spec, log_dir, f"{i:02d}-{spec.part}")
            if o.error:
                print(f"[bench]   error: {o.error}", file=sys.stderr)
            outcomes.append(o)
    except (KeyboardInterrupt, Interrupted) as e:
        status = 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
        print("[bench] interrupted; every started process was stopped", file=sys.stderr)
    titles = {
        "a": f"a. Frontend ceiling, 10 ms step, {args.duration:g} s window; "
        f"layout '{args.a_layout}' {LAYOUTS[args.a_layout]}",
        "b": f"b. -dp 2 (two API servers), 10 ms step; layout 'balance' {LAYOUTS['balance']}",
        "c": f"c. Connection-pool trap, two API servers; layout 'ceiling' {LAYOUTS['ceiling']}",
    }
    for part in args.parts:
        if any(o.spec.part == part for o in outcomes):
            print(f"\n{titles[part]}\n")
            print(table(outcomes, part))
            if part == "a":
                print("\n".join(["", *ceiling_ratio(outcomes)]))
    for o in outcomes:
        if o.error:
            print(f"\n- {o.spec.label} @ {o.spec.clients}: {o.error}")
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode([o.__dict__ for o in outcomes])))
    if not args.keep_logs and not any(o.error for o in outcomes):
        for f in log_dir.iterdir():
            f.unlink()
        log_dir.rmdir()
    return status or (0 if outcomes and all(o.error is None for o in outcomes) else 1)


if __name__ == "__main__":
    sys.exit(main())
