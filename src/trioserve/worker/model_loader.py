"""Which implementation serves a model folder, and loading it (``WorkerConfig.model_impl``).

Rules:

- ``auto``: the own decoder (``worker/decoder_model.py``) when ``decoder_spec`` takes the folder's
  config and the weights are safetensors; otherwise transformers' ``AutoModelForCausalLM``, with the
  reason logged. ``trioserve``: the own decoder or an error saying why not. ``transformers``: always
  transformers (its model classes are imported only on this path: they are most of a worker's
  start-up).
- The own decoder's tensors are the checkpoint file's pages, mapped (safetensors' ``safe_open``), and
  converted only where the checkpoint's dtype is not the one asked for, as transformers loads them.
- Both implementations have the same module names, so the packed-weights store
  (``worker/packed_store.py``), whose key includes them, is shared between them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from trioserve.worker.decoder_model import CausalLM, assign, build
from trioserve.worker.decoder_spec import DecoderSpec, Unsupported
from trioserve.worker.paged_attention import attach_to_transformers

log = logging.getLogger("trioserve.worker")

ModelImpl = Literal["auto", "trioserve", "transformers"]
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def load_model(folder: str, dtype: torch.dtype, impl: ModelImpl = "auto") -> tuple[Any, str]:
    """``folder``'s causal LM on the CPU in ``dtype``, in eval mode, and which implementation it is
    (``trioserve``, or ``transformers`` with why)."""
    if impl != "transformers":
        try:
            return own_model(folder, dtype), "trioserve"
        except Unsupported as e:
            if impl == "trioserve":
                raise ValueError(f"--model-impl trioserve cannot serve {folder}: {e}") from e
            reason = str(e)
    else:
        reason = "--model-impl transformers"
    return transformers_model(folder, dtype), f"transformers ({reason})"


def own_model(folder: str, dtype: torch.dtype) -> CausalLM:
    spec = DecoderSpec.from_model_dir(folder)
    return assign(build(spec), read_safetensors(Path(folder)), dtype).eval()


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``'s safetensors checkpoint (one file, or the files its index names),
    mapped from the files; ``Unsupported`` when it has none (``.bin`` checkpoints: transformers)."""
    if (folder / SINGLE).is_file():
        files = [folder / SINGLE]
    elif (folder / INDEX).is_file():
        weight_map: dict[str, str] = json.loads((folder / INDEX).read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        raise Unsupported(f"no {SINGLE} or {INDEX} in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                tensors[name] = f.get_tensor(name)
    return tensors


def transformers_model(folder: str, dtype: torch.dtype) -> Any:
    import transformers

    # No tqdm bars in the server's log: the runner logs one line saying how long loading took.
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    attach_to_transformers(model)
    return model.eval()
