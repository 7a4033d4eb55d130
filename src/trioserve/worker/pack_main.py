"""``python -m trioserve.worker.pack_main FOLDER``: pack a model folder's linears for the CPU kernels
and store them (``worker/packed_store.py``) without serving it.

``serve`` runs it once, as a child, right after it converts the embedded model (the first run), so
that the first start after the conversion maps the packed weights like every later one instead of
packing and writing them itself (a start of 6.7-7.8 s instead of ~4 s here). The model is loaded as
the worker loads it (``worker/model_loader.py``, in float32), so its packing plan, and with it the
store's key, is the worker's (the same with either ``--model-impl``: both have the same module
names). Exit code 0 when stored or already stored, 1 when the native kernels cannot build here (then
nothing is stored and the worker packs at each start, as it would anyway); it never touches the
folder itself.
"""

from __future__ import annotations

import logging
import sys

import torch

from trioserve.runtime.process import setup_logging
from trioserve.worker.model_loader import load_model
from trioserve.worker.native_kernels import native_kernels
from trioserve.worker.packed_linear import pack_linears
from trioserve.worker.packed_store import PackedStore

log = logging.getLogger("trioserve.worker")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trioserve.worker.pack_main FOLDER", file=sys.stderr)
        return 2
    setup_logging("info")
    folder = argv[0]
    kernels = native_kernels("auto", torch.device("cpu"), torch.float32)
    if kernels is None:
        log.info("packed weights not stored: the native CPU kernels do not build here")
        return 1
    model, _ = load_model(folder, torch.float32)
    with torch.no_grad():
        pack_linears(model, kernels, PackedStore(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
