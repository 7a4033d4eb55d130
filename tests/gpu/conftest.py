"""The CUDA tests (issue 18, item 6): skipped where torch sees no GPU, so the default run stays green
on CPU-only machines; on a GPU host, ``pytest tests/gpu`` runs them (they carry no ``long`` mark)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
