"""Folders built once and kept under ``$XDG_CACHE_HOME/trioserve/`` (the converted Qwen3 tokenizer, the
embedded model), with one rule that makes them safe to share between processes:

``final`` is only ever created by renaming a complete staging folder onto it, after the build stamp
(written last) and an fsync, so a reader sees a whole folder or none, and a crash mid-build leaves only a
hidden staging folder, swept by a later build once it is old. Racing builders each build privately; the
first rename wins and the others discard their copy. A folder without the expected stamp (stale or
foreign) is moved aside and replaced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

STAMP_FILE: Final = "trioserve_build.txt"
# Staging folders older than this are leftovers of a killed build (a build takes seconds).
STALE_STAGING_S: Final = 3600.0


def cache_root(kind: str) -> Path:
    """``$XDG_CACHE_HOME/trioserve/<kind>`` (``~/.cache/...`` when unset or empty)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trioserve" / kind


def stamp_ok(folder: Path, stamp: str) -> bool:
    try:
        return (folder / STAMP_FILE).read_text(encoding="utf-8").strip() == stamp
    except OSError:
        return False


def build_cached_folder(
    final: Path,
    build: Callable[[Path], None],
    stamp: str,
    progress: Callable[[str], None] = lambda _: None,
    what: str = "building",
) -> Path:
    """Return ``final``, first filling it with ``build(staging)`` unless it carries ``stamp`` already."""
    if stamp_ok(final, stamp):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_staging(root, final.name)
    progress(f"{what}...")
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        build(staging)
        (staging / STAMP_FILE).write_text(stamp + "\n", encoding="utf-8")
        _fsync_tree(staging)  # on disk before the rename commits it, even across a power cut
        if final.exists() and not stamp_ok(final, stamp):
            aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-stale-", dir=root))
            with contextlib.suppress(OSError):  # another builder moved it first
                final.rename(aside / final.name)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            staging.rename(final)
        except OSError:
            if not stamp_ok(final, stamp):
                raise  # not a lost race but a real failure
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"done in {time.monotonic() - started:.1f} s")
    return final


def _fsync_tree(folder: Path) -> None:
    for path in [*sorted(folder.rglob("*"), reverse=True), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sweep_stale_staging(root: Path, name: str) -> None:
    now = time.time()
    for leftover in root.glob(f".{name}-*"):
        with contextlib.suppress(OSError):
            if leftover.is_dir() and now - leftover.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
