"""The blocked linears' packed weights kept on disk between starts (issue 18, item 5: start-up).

Packing writes a new copy of every weight (``packed_linear.py``), and on this kind of VM writing
fresh memory is what costs at start-up: transformers maps a float32 checkpoint's tensors straight
from the file, so even packing over a weight's own memory takes a copy-on-write fault per page
(SmolLM2's 540 MB: 0.4-1.7 s of a load that is otherwise ~0.5 s). A packed copy read back from a
file is the page cache's pages, mapped, with nothing to fault in but the mapping; the first start
pays the packing once and writes the file.

Rules:

- One file per key under ``$XDG_CACHE_HOME/trioserve/packed/``. The key is a SHA-256 over what the
  bytes depend on: the model folder's path and each of its files' name, size and modification time;
  ``native/blocked_linear.c`` (the layout) and ``BLOCK``; the packing plan (each blocked linear's
  name and shape, in order). Another model, another checkpoint in the same folder, another layout or
  another set of linears is another key.
- ``load`` maps the file private (copy-on-write, never written) when it holds exactly the plan's
  floats; a missing file, another size or an ``OSError`` is ``None``, and the caller packs.
- ``save`` writes the tensors one after another under a private name in the folder and renames it
  onto the key's name, so racing workers each see a whole file or none; a failure (a full or
  read-only disk) is logged and leaves nothing behind. A saved store is never rewritten.
- Each entry has a ``.src`` beside it naming its model folder; a load that uses an entry touches
  its ``.src``. A save first removes the entries whose folder is gone (a model converted into a
  temporary folder, as tests do, leaves nothing for long) and, of its own folder's, all but the
  ``KEEP_PER_FOLDER - 1`` last used: every key but one is then stale or another configuration's (a
  checkpoint replaced in place, a trioserve whose layout changed, another set of linears), and
  without this bound each such change left another copy of the weights on disk for good (13 of
  SmolLM2's 540 MB on one development host). Two configurations of one folder alternating still
  each find theirs. A store larger than a quarter of the folder's free disk is not written
  (a model of tens of GB would double its footprint unasked): those starts pack every time. Removing
  the folder is always safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import torch

from trioserve.models.cached_folder import cache_root
from trioserve.worker.native_kernels import BLOCK, SOURCES

log = logging.getLogger("trioserve.worker")

MAX_SHARE_OF_FREE = 0.25  # of the cache folder's free disk a store may take
KEEP_PER_FOLDER = 2  # entries of one model folder kept: the last used, and the one being saved
Plan = list[tuple[str, int, int]]  # (linear's name, out features, in features), in packing order


class PackedStore:
    """Packed weights for the model in ``model_dir``, under ``root`` (the cache folder by default)."""

    def __init__(self, model_dir: str | Path, root: Path | None = None) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.root = root if root is not None else cache_root("packed")

    def path(self, plan: Plan) -> Path:
        digest = hashlib.sha256()
        digest.update(str(self.model_dir).encode())
        for entry in sorted(self.model_dir.iterdir()):
            if entry.is_file():
                stat = entry.stat()
                digest.update(f"\0{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        layout = next(source for source in SOURCES if source.name == "blocked_linear.c")
        digest.update(layout.read_bytes())
        digest.update(f"\0{BLOCK}\0{plan!r}".encode())
        return self.root / f"{digest.hexdigest()[:32]}.f32"

    def load(self, plan: Plan, floats: int) -> torch.Tensor | None:
        """The stored floats for ``plan`` (``floats`` of them, one tensor), or ``None``."""
        try:
            path = self.path(plan)
            with open(path, "rb") as file:
                if os.fstat(file.fileno()).st_size != 4 * floats or floats == 0:
                    return None
                mapping = mmap.mmap(file.fileno(), 4 * floats, access=mmap.ACCESS_COPY)
        except OSError:
            return None
        with contextlib.suppress(OSError):  # last used: what a save by another key keeps
            os.utime(path.with_suffix(".src"))
        log.info("packed weights from %s", path)
        return torch.frombuffer(mapping, dtype=torch.float32, count=floats)  # it keeps the mapping

    def _prune(self) -> None:
        """Remove the entries whose model folder is gone (and any without a ``.src``: a crash between
        a rename and its ``.src`` write, or a format before them), and all but the
        ``KEEP_PER_FOLDER - 1`` last used of this store's folder."""
        own: list[tuple[int, Path]] = []
        for entry in self.root.glob("*.f32"):
            source = entry.with_suffix(".src")
            try:
                folder = Path(source.read_text(encoding="utf-8"))
                used = source.stat().st_mtime_ns
            except OSError:
                folder = None
            if folder is None or not folder.is_dir():
                _remove(entry)
            elif folder == self.model_dir:
                own.append((used, entry))
        for _, entry in sorted(own, reverse=True)[KEEP_PER_FOLDER - 1 :]:
            _remove(entry)

    def save(self, plan: Plan, tensors: list[torch.Tensor]) -> None:
        """Write ``tensors`` (the plan's packed copies, in its order) as the plan's store."""
        staging: str | None = None
        try:
            path = self.path(plan)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._prune()
            size = sum(t.numel() for t in tensors) * 4
            free = shutil.disk_usage(path.parent).free
            if size > free * MAX_SHARE_OF_FREE:
                log.info(
                    "packed weights not stored: %.0f MB would take more than a quarter of the %.0f MB "
                    "free in %s; every start packs them", size / 1e6, free / 1e6, path.parent,
                )  # fmt: skip
                return
            fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".packing-")
            with os.fdopen(fd, "wb") as file:
                for tensor in tensors:
                    file.write(tensor.detach().contiguous().numpy().data)
            os.replace(staging, path)
            staging = None
            path.with_suffix(".src").write_text(str(self.model_dir), encoding="utf-8")
            log.info("packed weights stored in %s (%.0f MB) for the next start", path, size / 1e6)
        except OSError as error:
            log.warning("packed weights not stored (%s): the next start packs them again", error)
        finally:
            if staging is not None:
                Path(staging).unlink(missing_ok=True)


def _remove(entry: Path) -> None:
    entry.unlink(missing_ok=True)
    entry.with_suffix(".src").unlink(missing_ok=True)
