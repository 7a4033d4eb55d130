"""``worker/packed_store.py`` and ``pack_linears`` with a store: the second packing of a model reads
the first one's copies back (the same products, no packing), keyed by the model folder's files and
the plan; a store of another size, a missing or unwritable folder is no store, a failed write
leaves nothing, and a save prunes the entries of model folders that are gone."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from trioserve.worker.native_kernels import BLOCK, NativeKernels, build
from trioserve.worker.packed_linear import MIN_BLOCKED_IN, BlockedLinear, PackedEmbedding, pack_linears
from trioserve.worker.packed_store import PackedStore


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return NativeKernels(build())


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def tied_model() -> nn.Sequential:
    torch.manual_seed(5)
    embed = nn.Embedding(2 * BLOCK, MIN_BLOCKED_IN)
    head = nn.Linear(MIN_BLOCKED_IN, 2 * BLOCK, bias=False)
    head.weight = embed.weight
    up = nn.Linear(MIN_BLOCKED_IN, BLOCK + 5)  # padded: its own copy
    down = nn.Linear(BLOCK + 5, MIN_BLOCKED_IN)
    return nn.Sequential(embed, up, nn.ReLU(), down, head)


def test_the_second_packing_reads_the_first_ones_copies(
    kernels: NativeKernels, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PackedStore(model_dir, tmp_path / "packed")
    reference = tied_model()
    ids = torch.tensor([[0, 3, 2 * BLOCK - 1]])
    with torch.no_grad():
        want = reference(ids)
        first = copy.deepcopy(reference)
        pack_linears(first, kernels, store)
        (saved,) = (tmp_path / "packed").glob("*.f32")
        assert saved.stat().st_size == 4 * sum(
            m.packed.numel() for m in first if isinstance(m, BlockedLinear)
        )

        def no_packing(*_: object) -> None:
            raise AssertionError("packed again")

        monkeypatch.setattr(NativeKernels, "pack_linear", no_packing)
        monkeypatch.setattr(NativeKernels, "pack_linear_in_place", no_packing)
        second = copy.deepcopy(reference)
        pack_linears(second, kernels, store)
        assert isinstance(second[0], PackedEmbedding)  # the tied embedding reads the stored copy
        for a, b in zip(first, second, strict=True):
            if isinstance(a, BlockedLinear):
                assert isinstance(b, BlockedLinear) and torch.equal(a.packed, b.packed)
        torch.testing.assert_close(second(ids), want, rtol=1e-5, atol=1e-5)
        assert list((tmp_path / "packed").glob("*.f32")) == [saved]  # read, not rewritten


def test_the_key_follows_the_files_and_the_plan(model_dir: Path, tmp_path: Path) -> None:
    store = PackedStore(model_dir, tmp_path)
    plan = [("a", 64, 128)]
    key = store.path(plan)
    assert store.path(plan) == key
    assert store.path([("a", 64, 256)]) != key
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # another checkpoint, same size
    assert store.path(plan) != key
    (model_dir / "extra.json").write_text("{}")
    assert PackedStore(model_dir, tmp_path).path(plan) not in (key, store.path([("b", 1, 1)]))


def test_another_size_or_no_folder_is_no_store(model_dir: Path, tmp_path: Path) -> None:
    store = PackedStore(model_dir, tmp_path / "packed")
    plan = [("a", BLOCK, 8)]
    assert store.load(plan, BLOCK * 8) is None  # nothing stored yet
    store.save(plan, [torch.arange(BLOCK * 8, dtype=torch.float32)])
    assert torch.equal(store.load(plan, BLOCK * 8), torch.arange(BLOCK * 8, dtype=torch.float32))
    assert store.load(plan, BLOCK * 8 + 1) is None
    assert PackedStore(tmp_path / "missing", tmp_path / "packed").load(plan, BLOCK * 8) is None


def test_a_failed_write_leaves_nothing(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "packed"
    root.mkdir()
    store = PackedStore(model_dir, root)

    class Unwritable:
        def numel(self) -> int:
            return 1

        def detach(self) -> Unwritable:
            raise OSError("disk full")

    store.save([("a", 1, 1)], [Unwritable()])  # type: ignore[list-item]
    assert list(root.iterdir()) == []
    assert "not stored (disk full)" in caplog.text


def test_a_save_prunes_the_entries_of_folders_that_are_gone(tmp_path: Path) -> None:
    root = tmp_path / "packed"
    plan = [("a", BLOCK, 1)]
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    for folder in (kept, gone):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        PackedStore(folder, root).save(plan, [torch.zeros(BLOCK)])
    gone_entry = PackedStore(gone, root).path(plan)
    (root / "stray.f32").write_bytes(b"")  # no .src: pruned too
    for name in os.listdir(gone):
        os.remove(gone / name)
    gone.rmdir()
    other = tmp_path / "other"
    other.mkdir()
    PackedStore(other, root).save(plan, [torch.zeros(BLOCK)])
    names = sorted(p.name for p in root.iterdir())
    assert gone_entry.name not in names and "stray.f32" not in names
    assert PackedStore(kept, root).path(plan).name in names
    assert len(names) == 4  # kept and other, each with its .src


def test_a_folder_keeps_its_last_used_entries_only(model_dir: Path, tmp_path: Path) -> None:
    """Each new key of one folder (another layout, checkpoint or plan) would leave another copy of
    the weights behind: a save keeps the folder's last used entry besides its own, a load counts as
    a use, and another folder's entries are not touched."""
    root = tmp_path / "packed"
    store = PackedStore(model_dir, root)
    plans = [[("a", BLOCK, n)] for n in (1, 2, 3)]
    other = tmp_path / "other"
    other.mkdir()
    PackedStore(other, root).save(plans[0], [torch.zeros(BLOCK)])
    for n, plan in enumerate(plans[:2], 1):
        store.save(plan, [torch.zeros(BLOCK * n)])
    first, second = (store.path(plan) for plan in plans[:2])
    now = second.with_suffix(".src").stat().st_mtime_ns
    for entry, ago in ((first, 2), (second, 1)):  # first saved, then second, seconds apart
        os.utime(entry.with_suffix(".src"), ns=(now - ago * 10**9, now - ago * 10**9))
    assert store.load(plans[0], BLOCK) is not None  # first is now the last used
    store.save(plans[2], [torch.zeros(BLOCK * 3)])
    assert first.exists() and store.path(plans[2]).exists()
    assert not second.exists() and not second.with_suffix(".src").exists()
    assert PackedStore(other, root).path(plans[0]).exists()
    assert len(list(root.glob("*.f32"))) == 3


def test_a_store_too_large_for_the_free_disk_is_not_written(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "packed"
    store = PackedStore(model_dir, root)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=4 * 4 * BLOCK - 1))
    store.save([("a", BLOCK, 1)], [torch.zeros(BLOCK)])  # 128 bytes > a quarter of 511
    assert list(root.glob("*.f32")) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=4 * 4 * BLOCK))
    store.save([("a", BLOCK, 1)], [torch.zeros(BLOCK)])
    assert len(list(root.glob("*.f32"))) == 1
