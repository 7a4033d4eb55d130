"""The KV pool's prefault (worker/kv_prefault.py): the plan is the worker's own pool size, the order
covers every page with the lowest blocks first, a started prefault ends with every page resident, and
whatever cannot be used (another size, an unknown advice) is released for the in-line allocation."""

from __future__ import annotations

import ctypes
import json
import mmap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trioserve.config import WorkerConfig
from trioserve.models.geometry import KVGeometry
from trioserve.protocol.ring_layout import RingHandle
from trioserve.protocol.worker_messages import WorkerLaunch
from trioserve.runtime import placement
from trioserve.worker import kv_prefault
from trioserve.worker.kv_prefault import PoolPlan, Prefault, pool_plan, population_order
from trioserve.worker.paged_attention import PagedKVCache

PAGE = mmap.PAGESIZE


def resident_pages(mapping: mmap.mmap) -> list[bool]:
    """mincore(2) of the mapping: which pages are resident now."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-len(mapping) // PAGE)
    vec = ctypes.create_string_buffer(pages)
    holder = ctypes.c_char.from_buffer(mapping)
    try:
        assert libc.mincore(ctypes.addressof(holder), len(mapping), vec) == 0, ctypes.get_errno()
    finally:
        del holder
    return [byte[0] & 1 == 1 for byte in (vec.raw[i : i + 1] for i in range(pages))]


@given(
    planes=st.integers(1, 12),
    plane_pages=st.integers(1, 40),
    extra=st.integers(0, PAGE - 1),
    round_pages=st.integers(1, 64),
)
def test_the_order_covers_every_page_lowest_blocks_first(
    planes: int, plane_pages: int, extra: int, round_pages: int
) -> None:
    plane = plane_pages * PAGE - extra  # planes need not be page multiples
    plan = PoolPlan(plane * planes, planes)
    step = max(PAGE, round_pages * PAGE // planes // PAGE * PAGE)  # each plane's bytes per round
    ranges = list(population_order(plan, round_pages * PAGE, PAGE))
    assert len(ranges) == -(-plane // step) * planes
    covered: set[int] = set()
    for k, (at, length) in enumerate(ranges):
        assert at % PAGE == 0 and length % PAGE == 0
        # Round k // planes is bytes [r * step, (r + 1) * step) of plane k % planes: low blocks first.
        begin = (k % planes) * plane + (k // planes) * step
        end = (k % planes) * plane + min((k // planes + 1) * step, plane)
        assert begin - PAGE < at <= begin and at + length >= end and at + length - end < 2 * PAGE
        covered.update(range(at // PAGE, (at + length) // PAGE))
    assert covered >= set(range(-(-plan.nbytes // PAGE)))


def test_a_prefault_ends_with_every_page_resident_and_zero() -> None:
    plan = PoolPlan(48 << 20, 6)
    prefault = Prefault(plan, round_bytes=4 << 20)
    if not prefault.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert prefault.done.wait(60) and prefault.error is None
    mapping = prefault.take(plan.nbytes)
    assert mapping is not None and len(mapping) == plan.nbytes
    assert all(resident_pages(mapping))
    assert mapping[:16] == bytes(16) and mapping[-16:] == bytes(16)


def test_the_pool_takes_the_prefaulted_pages() -> None:
    shape = (2 * 3, 4, 16, 2, 8)  # 3 layers' keys and values
    nbytes = 6 * 4 * 16 * 2 * 8 * 4
    prefault = Prefault(PoolPlan(nbytes, 6))
    pages = prefault.take(nbytes)
    if pages is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    cache = PagedKVCache(3, *shape[1:], torch.float32, torch.device("cpu"), pages)
    cache.values[2][3, 15, 1, 7] = 2.0  # the pool's last element: the mapping's last 4 bytes
    prefault.done.wait(60)
    assert pages[-4:] == torch.tensor([2.0]).numpy().tobytes()
    assert all(t.abs().sum().item() == 0 for t in (*cache.keys, *cache.values[:2]))
    with pytest.raises(ValueError, match="prefaulted"):
        PagedKVCache(
            3, 5, 16, 2, 8, torch.float32, torch.device("cpu"), Prefault(PoolPlan(nbytes, 6)).take(nbytes)
        )


def test_a_prefault_of_another_size_or_an_unknown_advice_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = Prefault(PoolPlan(8 * PAGE, 2))
    assert wrong.take(16 * PAGE) is None and wrong.mapping is None
    monkeypatch.setattr(kv_prefault, "MADV_POPULATE_WRITE", 10_000)  # no kernel knows this advice
    unknown = Prefault(PoolPlan(8 * PAGE, 2))
    assert not unknown.supported and unknown.done.is_set()
    assert unknown.take(8 * PAGE) is None and unknown.mapping is None


def launch(model: Path, **worker: object) -> WorkerLaunch:
    ring = RingHandle("r", 2, 64, 1, "reader", 0, (), ())
    tp = int(worker.pop("tp", 1))  # type: ignore[call-overload]
    config = WorkerConfig(**worker)  # type: ignore[arg-type]
    return WorkerLaunch(
        model=str(model), worker=config, block_size=16, num_blocks=0, steps_ring=ring, tensor_parallel_size=tp
    )


def test_the_plan_is_the_pool_the_worker_allocates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    geometry = KVGeometry.from_model_dir(tmp_path)
    for dtype, name in (("auto", "float32"), ("bfloat16", "bfloat16")):
        plan = pool_plan(launch(tmp_path, device="cpu", dtype=dtype, kv_cache_gib=0.01))
        blocks = geometry.blocks_for(int(0.01 * (1 << 30)), 16, name)
        assert plan == PoolPlan(blocks * geometry.bytes_per_block(16, name), 6)
    assert pool_plan(launch(tmp_path, device="cuda")) is None
    assert pool_plan(launch(tmp_path, device="cpu", tp=2)) is None  # ranks agree on it after loading
    monkeypatch.setattr(placement, "NVIDIA_NODE", str(tmp_path / "config.json"))  # "a GPU host"
    assert pool_plan(launch(tmp_path, device="auto")) is None
    assert pool_plan(launch(tmp_path, device="cpu")) is not None
    assert kv_prefault.start(launch(tmp_path / "missing", device="cpu")) is None  # the load says why
