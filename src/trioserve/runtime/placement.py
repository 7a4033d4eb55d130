"""Where replicas run (seed 002, "Placement"), and how many CPU threads a worker may use.

A *device* is what one replica (one data-parallel rank: an engine core and its workers) is placed on:

- ``cpu:SET`` — a set of CPU cores, written as ranges and single cores joined by ``+``: ``cpu:0-3``,
  ``cpu:0+2``, ``cpu:0-1+6``. The rank's processes are pinned to those cores (their CPU affinity);
- ``cuda:N`` — GPU N, made the only GPU the rank's workers see (``CUDA_VISIBLE_DEVICES``).

Rules:

- ``--device-ids`` is a comma-separated list with one device per local rank, in rank order. Repeating a
  device puts several replicas on it, on purpose; the list's length must equal the number of ranks.
- Without device ids a model deployment of N > 1 replicas takes the first N devices: on CUDA, GPUs
  0..N-1; on the CPU, the available cores split into N disjoint sets of equal size (lowest cores first;
  a remainder stays unused). Too few devices is refused (``PlacementError``), never stacked silently.
- "Available" CPUs are what the process may really use: its affinity, and the cgroup CPU quota
  (``cpu.max``, or v1 ``cpu.cfs_quota_us``) rounded down, at least 1. ``os.cpu_count()`` is not.
- A CPU worker's default thread count is half its budget, rounded down, at least 1 and at most 16
  (``default_threads``); a configured count above the budget is capped to it (``worker_threads``).
- A CPU core set must lie within the available cores; a CUDA index must exist on this host.

Pure functions over values passed in, except the few that read the host (``available_cpus``,
``cgroup_cpu_quota``, ``cuda_device_count``) or change this process (``apply_cpu_affinity``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEVICE_IDS_HELP = (
    "one device per replica, comma-separated; a CPU device is a set of cores (cpu:0-3, cpu:0+2, "
    "cpu:0-1+6), a GPU is cuda:N; a repeated id puts several replicas on it. Default for a model "
    "with -dp N > 1: the first N GPUs, or the CPU's available cores split into N disjoint sets"
)
MAX_DEFAULT_THREADS = 16


class PlacementError(ValueError):
    """A placement that cannot be made; the message is the one-line reason."""


@dataclass(frozen=True, slots=True)
class Device:
    """One device: ``kind`` "cpu" with its ``cores``, or "cuda" with its ``index``."""

    kind: Literal["cpu", "cuda"]
    cores: frozenset[int] = frozenset()
    index: int = 0

    def __str__(self) -> str:
        if self.kind == "cuda":
            return f"cuda:{self.index}"
        return "cpu:" + "+".join(_ranges(sorted(self.cores)))


def _ranges(cores: list[int]) -> list[str]:
    """Sorted cores as the shortest list of ``a-b`` ranges and single cores."""
    out: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], -2]:
        if core == prev + 1:
            prev = core
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = core
    return out


def parse_device(text: str) -> Device:
    """One device id; ``PlacementError`` says what is wrong with it."""
    kind, sep, spec = text.strip().partition(":")
    if not sep or not spec:
        raise PlacementError(f"device id {text!r}: expected cpu:CORES or cuda:N")
    if kind == "cuda":
        if not spec.isdigit():
            raise PlacementError(f"device id {text!r}: a GPU is cuda:N with N a number")
        return Device("cuda", index=int(spec))
    if kind != "cpu":
        raise PlacementError(f"device id {text!r}: the kind is cpu or cuda")
    cores: set[int] = set()
    for part in spec.split("+"):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise PlacementError(f"device id {text!r}: cores are N, N-M or several joined by +")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise PlacementError(f"device id {text!r}: range {part} runs backwards")
        cores.update(range(first, last + 1))
    return Device("cpu", cores=frozenset(cores))


def parse_device_ids(text: str) -> tuple[Device, ...]:
    """A ``--device-ids`` list (comma-separated device ids)."""
    ids = [part for part in text.split(",") if part.strip()]
    if not ids:
        raise PlacementError("--device-ids is empty")
    return tuple(parse_device(part) for part in ids)


def available_cpus() -> frozenset[int]:
    """The cores this process may run on (its affinity)."""
    return frozenset(os.sched_getaffinity(0))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path | None = None) -> float | None:
    """The CPU quota of this process's cgroup, in cores (``cpu.max``, or v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``), the smallest along the path to the root; None when unlimited or unknown."""
    try:
        lines = (proc_cgroup or Path("/proc/self/cgroup")).read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers == "":  # v2: one unified hierarchy
            quotas += _along(root, path, lambda d: _v2_quota(d / "cpu.max"))
        elif "cpu" in names:
            base = root / controllers
            quotas += _along(base, path, _v1_quota)
    return min(quotas) if quotas else None


def _along(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """``read(dir)`` for ``base/path`` and each of its ancestors up to ``base``, where it answers."""
    found: list[float] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        quota = read(base.joinpath(*parts[:depth]))
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(file: Path) -> float | None:
    try:
        quota, _, period = file.read_text().strip().partition(" ")
    except OSError:
        return None
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_budget(cores: frozenset[int], quota: float | None) -> int:
    """How many cores' worth of CPU a process pinned to ``cores`` under ``quota`` may use (≥ 1)."""
    budget = len(cores)
    if quota is not None:
        budget = min(budget, math.floor(quota))
    return max(1, budget)


def default_threads(budget: int) -> int:
    """A CPU worker's threads when none are configured: half the budget, 1..16."""
    return max(1, min(MAX_DEFAULT_THREADS, budget // 2))


def worker_threads(configured: int, budget: int) -> tuple[int, bool]:
    """The threads a CPU worker runs: ``configured`` (0: the default) capped by the budget, and
    whether the cap applied (the caller logs it)."""
    if configured <= 0:
        return default_threads(budget), False
    return min(configured, budget), configured > budget


def default_placement(
    ranks: int, kind: Literal["cpu", "cuda"], cpus: frozenset[int], cuda_count: int
) -> tuple[Device, ...]:
    """The first ``ranks`` devices of ``kind``; ``PlacementError`` when there are fewer."""
    if kind == "cuda":
        if ranks > cuda_count:
            raise PlacementError(
                f"{ranks} replicas need {ranks} GPUs; this host has {cuda_count} "
                "(repeat an id in --device-ids to share one)"
            )
        return tuple(Device("cuda", index=i) for i in range(ranks))
    cores = sorted(cpus)
    if ranks > len(cores):
        raise PlacementError(
            f"{ranks} replicas need {ranks} CPU devices; this process may use {len(cores)} cores "
            "(repeat an id in --device-ids to share one)"
        )
    size = len(cores) // ranks
    return tuple(Device("cpu", cores=frozenset(cores[i * size : (i + 1) * size])) for i in range(ranks))


def check_placement(devices: Sequence[Device], ranks: int, cpus: frozenset[int], cuda_count: int) -> None:
    """``PlacementError`` unless ``devices`` places ``ranks`` ranks on devices this host has."""
    if len(devices) != ranks:
        raise PlacementError(f"--device-ids names {len(devices)} devices for {ranks} replicas")
    for device in devices:
        if device.kind == "cuda" and device.index >= cuda_count:
            raise PlacementError(f"{device}: this host has {cuda_count} GPUs")
        if device.kind == "cpu" and not device.cores <= cpus:
            allowed = Device("cpu", cores=cpus) if cpus else "no cores"
            raise PlacementError(f"{device}: this process may use {allowed} only")


NVIDIA_NODE = "/dev/nvidiactl"


def on_cpu(device: str) -> bool:
    """A worker ``--device`` that runs on the CPU, known without torch: ``cpu``, or ``auto`` where the
    host has no NVIDIA device node (if that is wrong either way, what is prepared for the CPU before
    the worker's load, its KV pool's pages or its packed weights, goes unused)."""
    return device == "cpu" or (device == "auto" and not os.path.exists(NVIDIA_NODE))


def cuda_device_count() -> int:
    """GPUs on this host, without importing torch into the calling process (nvidia device nodes)."""
    return sum(1 for p in Path("/dev").glob("nvidia[0-9]*"))


def apply_cpu_affinity(device: Device) -> None:
    """Pin this process (and the children it starts later) to ``device``'s cores."""
    os.sched_setaffinity(0, device.cores)


def cuda_env(device: Device) -> dict[str, str]:
    """The environment that makes ``device`` the only GPU a child sees."""
    return {"CUDA_VISIBLE_DEVICES": str(device.index)}
