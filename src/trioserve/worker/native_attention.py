"""Decode attention that reads the paged KV cache in place: ``native/paged_decode.c``, compiled on the
machine that runs it and called through ``ctypes`` (issue 18, item 2).

Why a plain C file and not torch's extension tooling: the kernel needs raw float pointers, nothing of
ATen, so it includes no torch header and builds in a fraction of a second with the C compiler a fresh
machine has (``cc``), where anything including ``torch/extension.h`` takes tens of seconds to compile
(and ``load_inline`` wants ninja too): a first start would pay that. ``ctypes`` releases the GIL for
the call, which is what lets several threads share one batch (``NativeDecode.__call__``).

Rules:

- ``build()`` returns the shared object for this source, these flags, this compiler and this CPU, from
  ``$XDG_CACHE_HOME/trioserve/kernels/`` when built there before, else compiled into it: written under
  a private name and renamed onto the final one, so racing workers (several engine ranks starting
  together) each see a whole file or none. It returns ``None`` and says why (``BuildFailed``) when
  there is no compiler or the build fails; the caller then keeps the pure-torch path.
- ``-march=native`` makes the object specific to the CPU it was built on, so the CPU's model name and
  flags are part of the cache key: a cache folder shared between machines never hands one the other's.
- The kernel's contract (shapes, float32, contiguity, valid block ids) is in the C file's header;
  ``NativeDecode`` checks the shapes and dtypes it is handed, once per call, because a wrong pointer
  there is a crash, not an exception.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import torch

from trioserve.models.cached_folder import cache_root

log = logging.getLogger(__name__)

SOURCE: Final = Path(__file__).with_name("native") / "paged_decode.c"
FLAGS: Final = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC")
SYMBOL: Final = "trioserve_paged_decode"
# Below this many requests per thread the split is not worth a thread hand-off (a few microseconds).
MIN_ROWS_PER_THREAD: Final = 4


class BuildFailed(Exception):
    """The kernel could not be built here; the message says why."""


def _cpu_identity() -> str:
    """The CPU's model name and flags (what ``-march=native`` compiles for), or the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(wanted)))


def build(compiler: str | None = None, root: Path | None = None) -> Path:
    """The kernel's shared object, built once per source, flags, compiler and CPU (the rules above).
    Raises ``BuildFailed`` when it cannot be built."""
    cc = compiler or os.environ.get("CC") or "cc"
    exe = shutil.which(cc)
    if exe is None:
        raise BuildFailed(f"no C compiler {cc!r} on PATH")
    try:
        version = subprocess.run(
            [exe, "--version"], check=False, capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildFailed(f"{cc} --version failed: {exc}") from exc
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_identity().encode()])
    ).hexdigest()[:20]
    folder = root or cache_root("kernels")
    final = folder / f"paged_decode-{key}.so"
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".paged_decode-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [exe, *FLAGS, "-o", staging, str(SOURCE), "-lm"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise BuildFailed(f"{cc} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(staging, final)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildFailed(f"{cc} failed: {exc}") from exc
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return final


class NativeDecode:
    """The loaded kernel: ``__call__`` is one layer's decode attention for a batch."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        fn = getattr(lib, SYMBOL)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float]
        fn.restype = None
        self._fn = fn
        self._library = lib  # keeps the object mapped while _fn lives
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._scratch: list[torch.Tensor] = []

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        threads: int = 1,
    ) -> torch.Tensor:
        """``q`` ``[B, H, D]``, caches ``[blocks, block_size, Hkv, D]``, ``tables`` ``[B, n]`` and
        ``lens`` ``[B]`` int64 (every ``lens[b]`` in ``1 .. n * block_size``) -> ``[B, H, D]``. With
        ``threads > 1`` the requests are split into that many contiguous slices, each run on its own
        thread (the calling one included)."""
        batch, heads, dim = q.shape
        _, block_size, kv_heads, cache_dim = key_cache.shape
        width = tables.shape[1]
        if (
            q.dtype != torch.float32
            or key_cache.dtype != torch.float32
            or value_cache.shape != key_cache.shape
            or value_cache.dtype != torch.float32
            or cache_dim != dim
            or heads % kv_heads
            or tables.dtype != torch.int64
            or lens.dtype != torch.int64
            or tables.shape[0] != batch
            or lens.shape != (batch,)
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())
            or q.device.type != "cpu"
        ):
            raise ValueError("native decode attention: unsupported shapes, dtypes or layout")
        q = q.contiguous()
        tables, lens = tables.contiguous(), lens.contiguous()
        out = torch.empty_like(q)
        parts = max(1, min(threads, batch // MIN_ROWS_PER_THREAD))
        need = heads // kv_heads * width * block_size  # scores of one group over the longest context
        if len(self._scratch) < parts or self._scratch[0].numel() < need:
            size = max([need] + [s.numel() for s in self._scratch])
            self._scratch = [torch.empty(size) for _ in range(max(parts, len(self._scratch)))]
        k, v = key_cache.data_ptr(), value_cache.data_ptr()
        row_floats = heads * dim

        def run(first: int, last: int, scratch: torch.Tensor) -> None:
            self._fn(
                q.data_ptr() + 4 * first * row_floats,
                k,
                v,
                tables.data_ptr() + 8 * first * width,
                lens.data_ptr() + 8 * first,
                out.data_ptr() + 4 * first * row_floats,
                scratch.data_ptr(),
                last - first,
                heads,
                kv_heads,
                dim,
                block_size,
                width,
                scale,
            )

        if parts == 1:
            run(0, batch, self._scratch[0])
            return out
        if self._pool is None or self._pool_size < parts - 1:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(parts - 1, thread_name_prefix="native-decode")
            self._pool_size = parts - 1
        bounds = [batch * i // parts for i in range(parts + 1)]
        futures = [
            self._pool.submit(run, bounds[i], bounds[i + 1], self._scratch[i]) for i in range(1, parts)
        ]
        run(bounds[0], bounds[1], self._scratch[0])
        for future in futures:
            future.result()
        return out


def native_decode(mode: str, device: torch.device, dtype: torch.dtype) -> NativeDecode | None:
    """The kernel ``WorkerConfig.attention_backend`` asks for on ``device`` in ``dtype``: ``None`` for
    torch's path. ``auto`` falls back to torch (logged) where the kernel does not apply or build;
    ``native`` raises ``ValueError`` there instead, so a worker asked for it never silently runs
    without it."""
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"attention backend {mode!r}: auto, native or torch")
    if mode == "torch":
        return None
    if device.type != "cpu" or dtype != torch.float32:
        if mode == "native":
            raise ValueError(f"the native attention backend runs on the CPU in float32, not {device} {dtype}")
        return None
    try:
        library = build()
    except BuildFailed as exc:
        if mode == "native":
            raise ValueError(f"the native attention backend did not build: {exc}") from exc
        log.warning("decode attention: the native kernel did not build (%s); using torch's", exc)
        return None
    return NativeDecode(library)
