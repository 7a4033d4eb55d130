"""The CPU worker's native kernels, compiled on the machine that runs them and called through
``ctypes`` (issue 18, item 2): decode attention that reads the paged KV cache in place
(``native/paged_decode.c``), the sampler's draw (``native/inverse_cdf.c``) and the linear layers'
products over weights packed in column blocks (``native/blocked_linear.c``), the gated MLP's
SiLU(gate) * up (``native/silu_mul.c``; with its two products in one pass for a prefill's rows,
``native/gated_linear.c``), RMSNorm (``native/rms_norm.c``) and the rotary embedding
(``native/rope.c``).

Why plain C files and not torch's extension tooling: the kernels need raw float pointers, nothing of
ATen, so they include no torch header and build in a fraction of a second with the C compiler a fresh
machine has (``cc``), where anything including ``torch/extension.h`` takes tens of seconds to compile
(and ``load_inline`` wants ninja too): a first start would pay that. ``ctypes`` releases the GIL for
the call, which is what lets several threads share one batch (``NativeKernels.decode``).

Rules:

- ``build()`` returns the shared object for these sources, these flags, this compiler and this CPU, from
  ``$XDG_CACHE_HOME/trioserve/kernels/`` when built there before, else compiled into it: written under
  a private name and renamed onto the final one, so racing workers (several engine ranks starting
  together) each see a whole file or none. It raises ``BuildFailed``, saying why, when there is no
  compiler or the build fails; ``native_kernels`` then keeps the pure-torch paths (or refuses).
- ``-march=native`` makes the object specific to the CPU it was built on, so the CPU's model name and
  flags are part of the cache key: a cache folder shared between machines never hands one the other's.
- Each kernel's contract (shapes, float32, contiguity, valid block ids) is in its C file's header;
  ``NativeKernels`` checks the shapes and dtypes it is handed, once per call, because a wrong pointer
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Final

import torch

from trioserve.models.cached_folder import cache_root

log = logging.getLogger(__name__)

SOURCES: Final = tuple(
    Path(__file__).with_name("native") / name
    for name in (
        "paged_decode.c",
        "inverse_cdf.c",
        "blocked_linear.c",
        "gated_linear.c",
        "silu_mul.c",
        "rms_norm.c",
        "rope.c",
    )
)
HEADERS: Final = tuple(
    Path(__file__).with_name("native") / name for name in ("exp_neg.h", "packed_rows.h")
)  # in the key, not on the command line
# -mprefer-vector-width=512: gcc 12 takes this Xeon for a Rocket Lake and then prefers 256-bit vectors,
# which left the blocked linear at ~100 GFLOP/s where oneDNN's AVX-512 reached ~170 (a 1,024-row
# product here); with 512-bit ones, 140-165. A compiler or CPU without AVX-512 ignores the preference.
FLAGS: Final = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    # -fno-trapping-math: without AVX-512's masks gcc 12 will not turn exp_neg.h's selects into blends
    # (it would evaluate a multiply the C only asks for on one side), so every loop calling it stayed
    # scalar with AVX2: silu_mul.c 13 ms -> 2 ms for a prefill's 1,024 x 1,536 on an AMD EPYC.
    # Nothing here reads the FP exception flags; results are unchanged (no reassociation).
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-shared",
    "-fPIC",
)
CHUNK: Final = 256  # inverse_cdf.c's CHUNK: its sums buffer holds vocab // CHUNK + 1 floats
BLOCK: Final = 32  # blocked_linear.c's BLOCK: output columns per packed block
# Below this many requests per thread the split is not worth a thread hand-off (a few microseconds).
MIN_ROWS_PER_THREAD: Final = 4
# Below this many multiply-adds per thread a linear is not split either (~40 us of work on one core
# here, several times a thread hand-off).
MIN_MACS_PER_THREAD: Final = 1 << 21


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
    """The kernels' shared object, built once per sources, flags, compiler and CPU (the rules above).
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
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(FLAGS).encode(), version.encode(), _cpu_identity().encode()])
    ).hexdigest()[:20]
    folder = root or cache_root("kernels")
    final = folder / f"cpu_kernels-{key}.so"
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [exe, *FLAGS, "-o", staging, *map(str, SOURCES), "-lm"],
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


def packed_size(out_features: int, in_features: int) -> int:
    """Floats in ``blocked_linear.c``'s packed copy of an ``[out, in]`` weight."""
    return -(-out_features // BLOCK) * in_features * BLOCK


class NativeKernels:
    """The loaded kernels: ``decode`` (one layer's decode attention for a batch), ``draw``, and
    ``pack_linear`` / ``linear``, ``gated_linear``, ``silu_mul``, ``rms_norm``, ``rope``."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._decode = lib.trioserve_paged_decode
        self._decode.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float]
        self._decode.restype = None
        self._draw = lib.trioserve_inverse_cdf
        self._draw.argtypes = [ptr] * 4 + [i64] * 2
        self._draw.restype = None
        self._pack = lib.trioserve_pack_linear
        self._pack.argtypes = [ptr, i64, i64, ptr]
        self._pack.restype = None
        self._pack_in_place = lib.trioserve_pack_linear_in_place
        self._pack_in_place.argtypes = [ptr, i64, i64, ptr]
        self._pack_in_place.restype = None
        self._linear = lib.trioserve_blocked_linear
        self._linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64]
        self._linear.restype = None
        self._gated = lib.trioserve_gated_linear
        self._gated.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64]
        self._gated.restype = None
        self._silu_mul = lib.trioserve_silu_mul
        self._silu_mul.argtypes = [ptr, ptr, ptr, i64]
        self._silu_mul.restype = None
        self._rms_norm = lib.trioserve_rms_norm
        self._rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
        self._rms_norm.restype = None
        self._rope = lib.trioserve_rope
        self._rope.argtypes = [ptr, i64, i64, i64, ptr, ptr]
        self._rope.restype = None
        self._library = lib  # keeps the object mapped while its functions live
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._scratch: list[torch.Tensor] = []

    def draw(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``inverse_cdf.c``: ``logits`` ``[rows, vocab]`` float32 (the warped ones), ``u`` ``[rows]``
        float32 in ``[0, 1)`` -> ``[rows]`` int64 token ids."""
        rows, vocab = logits.shape
        if (
            logits.dtype != torch.float32
            or u.dtype != torch.float32
            or u.shape != (rows,)
            or logits.device.type != "cpu"
        ):
            raise ValueError("native draw: unsupported shapes, dtypes or device")
        logits, u = logits.contiguous(), u.contiguous()
        out = torch.empty(rows, dtype=torch.long)
        sums = torch.empty(vocab // CHUNK + 1)
        self._draw(logits.data_ptr(), u.data_ptr(), out.data_ptr(), sums.data_ptr(), rows, vocab)
        return out

    def pack_linear(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``blocked_linear.c``'s packed copy of an ``[out, in]`` float32 weight (1-D), written into
        ``out`` when given (``packed_size`` contiguous floats, not the weight's own)."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("native linear: the weight must be a 2-D float32 CPU tensor")
        n, k = weight.shape
        weight = weight.contiguous()
        size = packed_size(n, k)
        if out is None:
            out = torch.empty(size)
        elif out.shape != (size,) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"native linear: a packed [{n}, {k}] weight takes {size} contiguous floats")
        self._pack(weight.data_ptr(), n, k, out.data_ptr())
        return out

    def pack_linear_in_place(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed layout over ``weight``'s own memory, returned as a 1-D view of it: for a
        contiguous ``[out, in]`` float32 weight whose ``out`` is a multiple of ``BLOCK`` (no padding)."""
        if (
            weight.dim() != 2
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or not weight.is_contiguous()
            or weight.shape[0] % BLOCK
        ):
            raise ValueError("native linear: in place, a contiguous float32 weight of whole blocks")
        n, k = weight.shape
        tmp = torch.empty(BLOCK * k)
        self._pack_in_place(weight.data_ptr(), n, k, tmp.data_ptr())
        return weight.view(-1)

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        threads: int = 1,
    ) -> torch.Tensor:
        """``x`` ``[..., in]`` float32 times the weight ``pack_linear`` packed (``out_features``
        rows), plus ``bias`` ``[out]`` -> ``[..., out]``. With ``threads > 1`` the column blocks are
        split into that many contiguous ranges, each run on its own thread (the calling one included)."""
        k = x.shape[-1]
        blocks = -(-out_features // BLOCK)
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or packed.dtype != torch.float32
            or packed.shape != (blocks * k * BLOCK,)
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)))
        ):
            raise ValueError("native linear: unsupported shapes, dtypes or device")
        rows = x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = torch.empty(*x.shape[:-1], out_features)
        if m == 0:
            return out
        bias = None if bias is None else bias.contiguous()  # held until the calls are done
        b = None if bias is None else bias.data_ptr()
        args = (rows.data_ptr(), m, k, packed.data_ptr(), out_features, b, out.data_ptr())
        self._over_blocks(
            self._linear, args, blocks, min(threads, m * k * out_features // MIN_MACS_PER_THREAD)
        )
        return out

    def _over_blocks(
        self, call: Callable[..., None], args: tuple[object, ...], blocks: int, parts: int
    ) -> None:
        """``call(*args, first, last)`` over ``blocks`` column blocks split into up to ``parts``
        contiguous ranges, one a thread."""
        parts = max(1, min(parts, blocks))
        if parts == 1:  # a decode step's usual case: ~200 calls a step, no hand-off to build
            call(*args, 0, blocks)
            return
        bounds = [blocks * i // parts for i in range(parts + 1)]
        self._split([partial(call, *args, bounds[i], bounds[i + 1]) for i in range(parts)])

    def gated_linear(
        self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out_features: int, threads: int = 1
    ) -> torch.Tensor:
        """``gated_linear.c``: ``SiLU(x Wg^T) * (x Wu^T)`` for ``x`` ``[..., in]`` float32 and the two
        weights as ``pack_linear`` packed them (``out_features`` rows each, no bias) -> ``[..., out]``,
        bit-equal to ``silu_mul(linear(x, gate), linear(x, up))``; the column blocks split over
        ``threads`` as ``linear`` splits them."""
        k = x.shape[-1]
        blocks = -(-out_features // BLOCK)
        size = (blocks * k * BLOCK,)
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or any(w.dtype != torch.float32 or w.shape != size for w in (gate, up))
        ):
            raise ValueError("native gated linear: unsupported shapes, dtypes or device")
        rows = x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = torch.empty(*x.shape[:-1], out_features)
        if m == 0:
            return out
        args = (rows.data_ptr(), m, k, gate.data_ptr(), up.data_ptr(), out_features, out.data_ptr())
        self._over_blocks(
            self._gated, args, blocks, min(threads, 2 * m * k * out_features // MIN_MACS_PER_THREAD)
        )
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu_mul.c``: ``SiLU(gate) * up`` for two float32 CPU tensors of one shape, written over
        ``gate`` when it is contiguous (the caller's gate product, used for nothing else), else into a
        new tensor."""
        if (
            gate.dtype != torch.float32
            or up.dtype != torch.float32
            or gate.shape != up.shape
            or gate.device.type != "cpu"
            or up.device.type != "cpu"
        ):
            raise ValueError("native silu_mul: unsupported shapes, dtypes or device")
        up = up.contiguous()
        out = gate if gate.is_contiguous() else gate.contiguous()
        self._silu_mul(out.data_ptr(), up.data_ptr(), out.data_ptr(), out.numel())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm.c`` over the last axis of a contiguous float32 CPU ``x`` with a ``weight`` as long
        as that axis, into a new tensor (``x`` is the residual the layer adds back later)."""
        n = x.shape[-1] if x.dim() else 0
        if (
            x.dtype != torch.float32
            or weight.dtype != torch.float32
            or not x.is_contiguous()
            or weight.shape != (n,)
            or x.device.type != "cpu"
            or weight.device.type != "cpu"
        ):
            raise ValueError("native rms_norm: unsupported shapes, dtypes or layout")
        weight = weight.contiguous()
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(n, 1), n, eps)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``rope.c``, in place: ``x`` ``[1, T, H, D]`` contiguous float32 CPU, ``cos`` and ``sin``
        ``[1, T, D]`` (the model's rotary embedding for the T positions); returns ``x``."""
        if x.dim() != 4 or cos.dim() != 3:
            raise ValueError("native rope: unsupported shapes, dtypes or layout")
        batch, tokens, heads, dim = x.shape
        if (
            batch != 1
            or dim % 2
            or cos.shape != (1, tokens, dim)
            or sin.shape != cos.shape
            or not x.is_contiguous()
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (x, cos, sin))
        ):
            raise ValueError("native rope: unsupported shapes, dtypes or layout")
        cos, sin = cos.contiguous(), sin.contiguous()
        self._rope(x.data_ptr(), tokens, heads, dim, cos.data_ptr(), sin.data_ptr())
        return x

    def _split(self, calls: list[Callable[[], object]]) -> None:
        """Run ``calls``: the first on this thread, the others at once on the pool's (ctypes releases
        the GIL in each)."""
        if len(calls) > 1 and (self._pool is None or self._pool_size < len(calls) - 1):
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(len(calls) - 1, thread_name_prefix="native-kernels")
            self._pool_size = len(calls) - 1
        futures = [self._pool.submit(call) for call in calls[1:]] if self._pool is not None else []
        calls[0]()
        for future in futures:
            future.result()

    def decode(
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
        need = heads * width * block_size  # every head's scores over the longest context
        if len(self._scratch) < parts or self._scratch[0].numel() < need:
            size = max([need] + [s.numel() for s in self._scratch])
            self._scratch = [torch.empty(size) for _ in range(max(parts, len(self._scratch)))]
        k, v = key_cache.data_ptr(), value_cache.data_ptr()
        row_floats = heads * dim

        def run(first: int, last: int, scratch: torch.Tensor) -> None:
            self._decode(
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

        bounds = [batch * i // parts for i in range(parts + 1)]
        self._split([partial(run, bounds[i], bounds[i + 1], self._scratch[i]) for i in range(parts)])
        return out


def native_kernels(mode: str, device: torch.device, dtype: torch.dtype) -> NativeKernels | None:
    """The kernels ``WorkerConfig.cpu_kernels`` asks for on ``device`` in ``dtype``: ``None`` for
    torch's paths. ``auto`` falls back to torch (logged) where the kernels do not apply or build;
    ``native`` raises ``ValueError`` there instead, so a worker asked for them never silently runs
    without them."""
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"cpu kernels {mode!r}: auto, native or torch")
    if mode == "torch":
        return None
    if device.type != "cpu" or dtype != torch.float32:
        if mode == "native":
            raise ValueError(f"the native CPU kernels run on the CPU in float32, not {device} {dtype}")
        return None
    try:
        library = build()
    except BuildFailed as exc:
        if mode == "native":
            raise ValueError(f"the native CPU kernels did not build: {exc}") from exc
        log.warning(
            "the native CPU kernels did not build (%s); decode attention and the draw use torch's", exc
        )
        return None
    return NativeKernels(library)
