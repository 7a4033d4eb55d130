"""The intra-op thread count of each forward, stated on a per-process context (issue 15, item 4).

Rules (the facts behind them: docs/threads.md, "What torch.set_num_threads does"):

- Every forward a worker runs (served, shadow, golden) goes through ``ThreadContext.use(n)`` first, so
  it never runs at a count some earlier forward or another thread left behind.
- With torch's OpenMP backend, ``torch.set_num_threads(n)`` sets the *calling thread's* OpenMP
  ``nthreads`` (its next parallel region's team size) and MKL's thread-local count; it also stores
  ``n`` in a process-wide value that any thread copies at its first parallel region. So a count is
  per calling thread once set, and a fresh thread inherits the last count set anywhere: that is why
  each forward states its own.
- Every ``set_num_threads`` call also clears oneDNN's kernel cache, process-wide. So ``use`` calls it
  only when the calling thread's count (``torch.get_num_threads()``: OpenMP's ``omp_get_max_threads``
  on this thread) differs from ``n``: a worker serving at one count sets it once, not per forward.
- ``n <= 0`` leaves the count alone (torch's default): what a CUDA worker or ``num_threads=0`` means.

``ThreadContext`` counts the set calls it made (``sets``) and remembers the count of the latest
forward it prepared on each thread (``current``), for logs and tests.
"""

from __future__ import annotations

import threading

import torch


def parallel_backend() -> str:
    """The ATen parallel backend torch was built with (``OpenMP``, ``native thread pool``, ...), as
    ``torch.__config__.parallel_info()`` names it; ``unknown`` if it does not say."""
    for line in torch.__config__.parallel_info().splitlines():
        if line.startswith("ATen parallel backend:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


class ThreadContext:
    """States the thread count of each forward on the calling thread (the module docstring's rules)."""

    def __init__(self) -> None:
        self.sets = 0  # torch.set_num_threads calls made through this context
        self._local = threading.local()
        self.backend = parallel_backend()

    def use(self, count: int) -> int:
        """Make the calling thread's next parallel regions run ``count`` threads (``<= 0``: leave it);
        returns the count now in force on this thread."""
        if count > 0 and torch.get_num_threads() != count:
            torch.set_num_threads(count)
            self.sets += 1
        current = torch.get_num_threads()
        self._local.count = current
        return current

    @property
    def current(self) -> int | None:
        """The count of the latest forward prepared on the calling thread, None before the first."""
        count: int | None = getattr(self._local, "count", None)
        return count
