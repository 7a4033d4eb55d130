"""What a reload may ask (launch/resize.py's ``read_resize``), and where ``--max-data-parallel-size``
is refused (cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve.cli import build_parser, serve_config
from trioserve.config_file import load_config_file
from trioserve.launch.resize import read_resize


def _read(
    settings: dict[str, object], baseline: dict[str, object] | None = None, placed: tuple[str, ...] = ()
) -> int:
    return read_resize(settings, baseline or settings, capacity=3, placed=placed).desired


def test_the_replica_count_is_the_files() -> None:
    assert _read({"data_parallel_size": 2}) == 2
    with pytest.raises(ValueError, match="names no replica count"):
        _read({"max_num_seqs": 8})
    for bad in (0, 4, True, "2"):
        with pytest.raises(ValueError, match="started for 1 to 3 replicas"):
            _read({"data_parallel_size": bad})


def test_other_changed_settings_are_named_not_applied() -> None:
    resize = read_resize(
        {"data_parallel_size": 2, "max_num_seqs": 8, "kind": "mock"},
        {"data_parallel_size": 1, "max_num_seqs": 16, "kind": "mock", "block_size": 32},
        capacity=3,
        placed=(),
    )
    assert resize.desired == 2
    assert resize.ignored == ("block_size", "max_num_seqs")


def test_devices_must_be_the_running_placement() -> None:
    placed = ("cpu:0", "cpu:1", "cpu:0")
    assert _read({"data_parallel_size": 2, "device_ids": ("cpu:0", "cpu:1")}, placed=placed) == 2
    assert _read({"data_parallel_size": 2, "device_ids": "cpu:0-0,cpu:1"}, placed=placed) == 2  # canonical
    with pytest.raises(ValueError, match="does not move replicas"):
        _read({"data_parallel_size": 2, "device_ids": ("cpu:1", "cpu:0")}, placed=placed)
    with pytest.raises(ValueError, match="does not move replicas"):
        _read({"data_parallel_size": 1, "device_ids": ("cpu:0",)}, placed=())
    with pytest.raises(ValueError, match="device_ids"):
        _read({"data_parallel_size": 1, "device_ids": ("tpu:0",)}, placed=placed)


def test_the_seed_replicas_list_gives_the_count(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("replicas:\n  - device: cpu:0\n  - device: cpu:0\n")
    settings = load_config_file(cfg)
    assert read_resize(settings, {}, capacity=4, placed=("cpu:0",) * 4).desired == 2


def _serve(*flags: str) -> object:
    return serve_config(build_parser().parse_args(["serve", "--engine", "mock", *flags]))


def test_max_data_parallel_size_sizes_the_tree(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("data_parallel_size: 1\n")
    config = serve_config(
        build_parser().parse_args(
            ["serve", "--engine", "mock", "--config", str(cfg), "--max-data-parallel-size", "3"]
        )
    )
    assert config.engine.data_parallel_size == 1 and config.engine.capacity == 3
    assert config.supervised  # one replica now, a supervisor to start more
    assert config.api_server_count == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("-dp", "2", "--max-data-parallel-size", "1"), "1 is below -dp 2"),
        (("--max-data-parallel-size", "2"), "give --config"),
        (("--max-data-parallel-size", "2", "--data-parallel-size-local", "1"), "not with remote ones"),
        (("--drain-timeout", "5"), "only with --max-data-parallel-size"),
    ],
)
def test_max_data_parallel_size_is_refused_where_a_resize_cannot_act(
    flags: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _serve(*flags)
