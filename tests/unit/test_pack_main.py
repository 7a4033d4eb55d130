"""``python -m trioserve.worker.pack_main``: a model folder packed and stored as the worker would pack
it, so that the worker's own load then reads the store, with either model implementation; and
``serve``'s rule for when it runs (a just-converted embedded model the workers will pack: one CPU rank
in float32, kernels not off)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_model_runner import tiny_model
from trioserve.config import ServeConfig, override
from trioserve.launch.serve import packs_for_cpu_kernels
from trioserve.runtime import placement
from trioserve.worker import pack_main
from trioserve.worker.model_runner import ModelRunner, RunnerConfig
from trioserve.worker.native_kernels import NativeKernels


@pytest.mark.parametrize("implementation", ["trioserve", "transformers"])
def test_the_worker_reads_what_pack_main_stored(
    implementation: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "model"
    model = tiny_model("llama")
    model.config.hidden_size = 128  # wide enough for the column blocks (MIN_BLOCKED_IN)
    big = type(model)(model.config)
    big.save_pretrained(folder)
    assert pack_main.main([str(folder)]) == 0
    stored = list((tmp_path / "xdg" / "trioserve" / "packed").glob("*.f32"))
    assert len(stored) == 1

    def no_packing(*_: object) -> None:
        raise AssertionError("the worker packed again")

    monkeypatch.setattr(NativeKernels, "pack_linear", no_packing)
    monkeypatch.setattr(NativeKernels, "pack_linear_in_place", no_packing)
    config = RunnerConfig(str(folder), 16, 4, "cpu", "float32", 1, tokenizer=None, model_impl=implementation)
    runner = ModelRunner.load(config)
    assert runner.implementation == implementation
    assert runner.packed_linears > 0
    assert pack_main.main([]) == 2


@pytest.mark.parametrize(
    ("settings", "packs"),
    [
        ({}, True),
        ({"device": "cpu", "dtype": "float32"}, True),
        ({"cpu_kernels": "torch"}, False),
        ({"tensor_parallel_size": 2}, False),
        ({"device": "cpu", "dtype": "bfloat16"}, False),
        ({"device": "cuda"}, False),
    ],
)
def test_when_serve_packs_after_converting(
    settings: dict[str, object], packs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(placement, "NVIDIA_NODE", "/nonexistent")  # no NVIDIA device
    assert packs_for_cpu_kernels(override(ServeConfig(), **settings)) is packs
    if not settings:
        monkeypatch.setattr(placement, "NVIDIA_NODE", __file__)  # one there
        assert not packs_for_cpu_kernels(ServeConfig())
