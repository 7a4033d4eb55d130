"""The CPU KV pool's pages, faulted in on a thread from before torch's imports (start-up, issue 18).

A CPU worker's pool (2 GiB by default) should be resident when it serves (``paged_attention.zeroed``
says why: a first write's fault in a step made the served tiny model 30 % slower), and on this kind of
VM a page's first touch is what costs: 0.9-4.8 s for 2 GiB, which used to run in line after the
imports (3-4 s) and before the worker said ready. So ``worker`` starts a ``Prefault`` before it
imports torch, and ``PagedKVCache`` takes its mapping when the model has loaded, waiting for what is
left of the population (usually nothing: 2 GiB were resident by the end of the imports in every start
measured). Saying ready first and populating beside the first steps was measured too and halved
their throughput (``docs/benchmarks.md``).

Rules:

- Only the worker's main thread calls ``Prefault``'s methods; the thread touches nothing but the
  mapping, through its address, and its own fields, which the main thread reads after ``done``.
- The thread populates with ``madvise(MADV_POPULATE_WRITE)`` through ctypes (which drops the GIL for
  each call), in rounds over the block ids: each round covers the same run of blocks in every layer's
  keys and values (the pool's ``planes``), so the blocks the ledger hands out first (an empty ledger
  hands out 0, 1, 2, ...) are the first resident. Not one ``MAP_POPULATE`` mmap: that holds the
  process's memory-map lock for the whole 2 GiB, and the imports' own mappings waited behind it (they
  ran 2.5x slower); in chunks they lose 1-2 s.
- It does not ask for transparent huge pages (``MADV_HUGEPAGE``). On one host that hint populated 2
  GiB in 0.2-1.0 s instead of 0.9-1.4 s where the memory was backed already, and both took 2.5-3.7 s
  where it was not; on another (a Xeon VM whose kernel compacts memory for each huge page it faults
  in) it took 5.0-5.5 s against 0.6-0.9 s, and start-up to ready went 4.6-4.8 s with a 0.25-GiB pool
  and 7.1-7.6 s with 2 GiB. Decode attention over a pool on 4 KB pages was 0-10 % slower in
  process (``docs/benchmarks.md``), which is not worth seconds of every start.
- ``Prefault`` checks that the kernel knows ``MADV_POPULATE_WRITE`` (Linux 5.14) before it starts;
  where it does not, ``take`` returns ``None`` and the caller allocates the pool populated in line, as
  before. A mapping of another size than asked is never handed out. A population that fails part way
  (out of memory) is logged; the rest of the pool faults in as written.
- The plan (``pool_plan``) is the same arithmetic as the worker's load (``KVGeometry.blocks_for``),
  for the cases whose pool is known before torch: one rank, on the CPU (``runtime.placement.on_cpu``:
  ``auto`` counts as the CPU where the host has no NVIDIA device node; if that is wrong either way,
  the pool is only allocated in line, or a prefaulted one is released unused).

This module imports no torch: it runs before torch is imported.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trioserve.models.geometry import KVGeometry
from trioserve.protocol.worker_messages import WorkerLaunch
from trioserve.runtime.placement import on_cpu

log = logging.getLogger("trioserve.worker")

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
ROUND_BYTES = 256 << 20  # populated per round, over all planes


@dataclass(frozen=True, slots=True)
class PoolPlan:
    nbytes: int
    planes: int  # equal, block-major parts: each layer's keys, then each layer's values


def pool_plan(launch: WorkerLaunch) -> PoolPlan | None:
    """The CPU KV pool this worker will allocate, when it is known before torch."""
    worker = launch.worker
    if launch.tensor_parallel_size != 1 or not on_cpu(
        worker.device
    ):  # ranks agree on their pool after loading
        return None
    dtype = "float32" if worker.dtype == "auto" else worker.dtype
    geometry = KVGeometry.from_model_dir(launch.model)
    blocks = launch.num_blocks or geometry.blocks_for(launch.kv_cache_bytes, launch.block_size, dtype)
    if blocks < 1:
        return None
    return PoolPlan(blocks * geometry.bytes_per_block(launch.block_size, dtype), 2 * geometry.num_layers)


def population_order(plan: PoolPlan, round_bytes: int, page: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` ranges of the pool, page-aligned, covering it whole, lowest blocks first:
    round ``r`` is the same run of each plane's bytes (each plane is block-major), ``round_bytes`` in
    all. A range may run into the next plane by less than a page (populating a page twice is free)."""
    plane = plan.nbytes // plan.planes
    step = max(page, round_bytes // plan.planes // page * page)
    for offset in range(0, plane, step):
        for first in range(0, plan.nbytes, plane):
            at = (first + offset) // page * page
            end = min(first + min(offset + step, plane), plan.nbytes)
            yield at, -(-(end - at) // page) * page


def _madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


class Prefault:
    """An anonymous private mapping of ``plan.nbytes``, being populated on a thread."""

    def __init__(self, plan: PoolPlan, round_bytes: int = ROUND_BYTES) -> None:
        self.plan = plan
        self.mapping: mmap.mmap | None = mmap.mmap(
            -1, plan.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        holder = ctypes.c_char.from_buffer(self.mapping)
        self._address = ctypes.addressof(holder)
        del holder  # the buffer export ends here, so the mapping can be closed later
        self._madvise = _madvise()
        # Length 0 checks only that the kernel knows the advice (EINVAL before Linux 5.14).
        self.supported = self._madvise(self._address, 0, MADV_POPULATE_WRITE) == 0
        self.done = threading.Event()  # set when the thread has ended, populated or not
        self.error: str | None = None
        self.seconds = 0.0
        self.populated = False  # every page, once the thread has ended
        self._stop = False
        if not self.supported:
            self.done.set()
            return
        self._thread = threading.Thread(target=self._populate, args=(round_bytes,), name="kv-prefault")
        self._thread.daemon = True  # a worker exiting while it runs needs no join
        self._thread.start()

    def _populate(self, round_bytes: int) -> None:
        started = time.perf_counter()
        try:
            for at, length in population_order(self.plan, round_bytes, mmap.PAGESIZE):
                if self._stop:
                    return
                if self._madvise(self._address + at, length, MADV_POPULATE_WRITE) != 0:
                    self.error = f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}"
                    log.warning("KV pool prefault stopped (%s): the rest faults in when written", self.error)
                    return
            self.seconds = time.perf_counter() - started
            self.populated = True
        finally:
            self.done.set()

    def take(self, nbytes: int) -> mmap.mmap | None:
        """The mapping, once populated, if it is ``nbytes`` long; else ``None`` (and it is released)."""
        if not self.supported or self.plan.nbytes != nbytes:
            log.info("KV pool not prefaulted (%s): populating it in line", self._why_not(nbytes))
            self.release()
            return None
        waited = time.perf_counter()
        self.done.wait()
        mapping, self.mapping = self.mapping, None
        if self.populated:  # said here: the worker sets its logging up after the imports
            log.info(
                "KV pool resident: %.2f GiB in %.1f s (%.1f s of it waited for after the imports)",
                self.plan.nbytes / (1 << 30),
                self.seconds,
                time.perf_counter() - waited,
            )
        return mapping

    def _why_not(self, nbytes: int) -> str:
        if not self.supported:
            return "the kernel has no MADV_POPULATE_WRITE"
        return f"{self.plan.nbytes} bytes prefaulted, {nbytes} needed"

    def release(self) -> None:
        """Drop the mapping unused (the pool went elsewhere: a GPU, or another size)."""
        self._stop = True
        self.done.wait()
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


def start(launch: WorkerLaunch) -> Prefault | None:
    """A ``Prefault`` for this worker's pool, or ``None`` when its size is not known yet (or the
    planning failed: the load will say why, with the model's own error)."""
    try:
        plan = pool_plan(launch)
    except (ValueError, KeyError, OSError):
        return None
    return Prefault(plan) if plan is not None else None
