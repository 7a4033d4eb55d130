"""Placement (runtime/placement.py): device ids, the CPU budget, default placements, worker threads;
and serve's placement of its ranks (cli.place_replicas) and an engine core putting itself there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trioserve.cli import build_parser, place_replicas, serve_config
from trioserve.config import EngineProcessConfig, ServeConfig, override
from trioserve.engine.main import place
from trioserve.runtime.placement import (
    Device,
    PlacementError,
    cgroup_cpu_quota,
    check_placement,
    cpu_budget,
    default_placement,
    default_threads,
    parse_device,
    parse_device_ids,
    worker_threads,
)

# ---------------------------------------------------------------------------------- device ids


@pytest.mark.parametrize(
    ("text", "cores", "canonical"),
    [
        ("cpu:0", {0}, "cpu:0"),
        ("cpu:0-3", {0, 1, 2, 3}, "cpu:0-3"),
        ("cpu:0+2", {0, 2}, "cpu:0+2"),
        ("cpu:0-1+6", {0, 1, 6}, "cpu:0-1+6"),
        ("cpu:3+0-2", {0, 1, 2, 3}, "cpu:0-3"),
        (" cpu:5-5 ", {5}, "cpu:5"),
    ],
)
def test_cpu_ids_are_core_sets_written_canonically(text: str, cores: set[int], canonical: str) -> None:
    device = parse_device(text)
    assert device.kind == "cpu"
    assert device.cores == cores
    assert str(device) == canonical
    assert parse_device(str(device)) == device


def test_cuda_ids() -> None:
    assert parse_device("cuda:1") == Device("cuda", index=1)
    assert str(parse_device("cuda:0")) == "cuda:0"


@pytest.mark.parametrize("text", ["cpu", "cpu:", "gpu:0", "cuda:x", "cpu:3-1", "cpu:a", "cpu:1-", "0"])
def test_bad_ids_are_refused_with_the_reason(text: str) -> None:
    with pytest.raises(PlacementError, match="device id"):
        parse_device(text)


def test_a_list_keeps_order_and_repeats() -> None:
    devices = parse_device_ids("cpu:1,cpu:0,cpu:1")
    assert [str(d) for d in devices] == ["cpu:1", "cpu:0", "cpu:1"]
    with pytest.raises(PlacementError, match="empty"):
        parse_device_ids(" , ")


# ------------------------------------------------------------------------------------ the budget


def _cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc_file = tmp_path / "proc_cgroup"
    proc_file.write_text(proc)
    return root, proc_file


def test_cgroup_v2_quota_is_the_smallest_along_the_path(tmp_path: Path) -> None:
    root, proc = _cgroup(
        tmp_path,
        "0::/a/b\n",
        {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "150000 100000\n", "cpu.max": "400000 100000\n"},
    )
    assert cgroup_cpu_quota(root, proc) == 1.5


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = _cgroup(
        tmp_path,
        "4:memory:/x\n2:cpu,cpuacct:/x\n",
        {"cpu,cpuacct/x/cpu.cfs_quota_us": "300000", "cpu,cpuacct/x/cpu.cfs_period_us": "100000"},
    )
    assert cgroup_cpu_quota(root, proc) == 3.0


def test_no_quota_when_unlimited_or_unreadable(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None
    root, proc = _cgroup(
        tmp_path,
        "1:cpu:/\n",
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
    )
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "missing") is None


def test_budget_is_affinity_under_the_quota_at_least_one() -> None:
    assert cpu_budget(frozenset(range(8)), None) == 8
    assert cpu_budget(frozenset(range(8)), 2.5) == 2
    assert cpu_budget(frozenset(range(2)), 6.0) == 2
    assert cpu_budget(frozenset(range(8)), 0.5) == 1


@pytest.mark.parametrize(("budget", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (9, 4), (32, 16), (64, 16)])
def test_default_threads_are_half_the_budget_1_to_16(budget: int, threads: int) -> None:
    assert default_threads(budget) == threads


def test_a_configured_count_is_capped_by_the_budget() -> None:
    assert worker_threads(0, 8) == (4, False)
    assert worker_threads(3, 8) == (3, False)
    assert worker_threads(8, 8) == (8, False)
    assert worker_threads(12, 8) == (8, True)


# ----------------------------------------------------------------------------------- placements


def test_default_cpu_placement_splits_the_cores_disjointly() -> None:
    four = frozenset({0, 1, 2, 3})
    assert [str(d) for d in default_placement(2, "cpu", four, 0)] == ["cpu:0-1", "cpu:2-3"]
    assert [str(d) for d in default_placement(3, "cpu", four, 0)] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [str(d) for d in default_placement(2, "cpu", frozenset({2, 5, 7}), 0)] == ["cpu:2", "cpu:5"]


def test_default_placement_refuses_too_few_devices() -> None:
    with pytest.raises(PlacementError, match="3 replicas need 3 CPU devices; this process may use 2"):
        default_placement(3, "cpu", frozenset({0, 1}), 0)
    with pytest.raises(PlacementError, match="2 replicas need 2 GPUs; this host has 1"):
        default_placement(2, "cuda", frozenset({0}), 1)
    assert [str(d) for d in default_placement(2, "cuda", frozenset(), 4)] == ["cuda:0", "cuda:1"]


def test_given_ids_must_fit_the_host_and_the_ranks() -> None:
    cpus = frozenset({0, 1})
    check_placement(parse_device_ids("cpu:0,cpu:0"), 2, cpus, 0)  # repeating one is allowed
    with pytest.raises(PlacementError, match="names 1 devices for 2 replicas"):
        check_placement(parse_device_ids("cpu:0"), 2, cpus, 0)
    with pytest.raises(PlacementError, match="cpu:1-3: this process may use cpu:0-1 only"):
        check_placement(parse_device_ids("cpu:1-3"), 1, cpus, 0)
    with pytest.raises(PlacementError, match="cuda:1: this host has 1 GPUs"):
        check_placement(parse_device_ids("cuda:1"), 1, cpus, 1)


# ------------------------------------------------------------------------------ serve's placement


def _model(**values: object) -> ServeConfig:
    return override(ServeConfig(), kind="model", device="cpu", **values)


def test_a_model_with_several_ranks_is_placed_on_disjoint_cores() -> None:
    placed = place_replicas(_model(data_parallel_size=2), frozenset(range(4)), 0)
    assert placed.engine.device_ids == ("cpu:0-1", "cpu:2-3")
    # Local ranks only: the others are placed by the hosts that start them.
    placed = place_replicas(_model(data_parallel_size=4, data_parallel_size_local=2), frozenset(range(4)), 0)
    assert placed.engine.device_ids == ("cpu:0-1", "cpu:2-3")


def test_one_rank_and_engines_without_a_model_are_not_placed() -> None:
    assert place_replicas(_model(), frozenset(range(4)), 0).engine.device_ids == ()
    mock = override(ServeConfig(), kind="mock", data_parallel_size=8)
    assert place_replicas(mock, frozenset(range(2)), 0).engine.device_ids == ()


def test_too_few_devices_is_refused() -> None:
    with pytest.raises(PlacementError, match="3 replicas need 3 CPU devices"):
        place_replicas(_model(data_parallel_size=3), frozenset({0, 1}), 0)
    with pytest.raises(PlacementError, match="2 replicas need 2 GPUs"):
        place_replicas(override(_model(data_parallel_size=2), device="cuda"), frozenset({0, 1}), 1)


def test_given_ids_are_checked_here() -> None:
    ok = _model(data_parallel_size=2, device_ids=("cpu:1", "cpu:1"))
    assert place_replicas(ok, frozenset({0, 1}), 0) == ok
    with pytest.raises(ValueError, match="argument --device-ids: cpu:7: this process may use"):
        place_replicas(_model(device_ids=("cpu:7",)), frozenset({0, 1}), 0)
    with pytest.raises(ValueError, match="not also --device cuda:N"):
        place_replicas(override(_model(device_ids=("cuda:0",)), device="cuda:0"), frozenset(), 1)
    with pytest.raises(ValueError, match="external places its own"):
        place_replicas(override(ServeConfig(), kind="external", device_ids=("cpu:0",)), frozenset({0}), 0)


def test_the_flag_writes_canonical_ids() -> None:
    ns = build_parser().parse_args(["serve", "--engine", "mock", "-dp", "2", "--device-ids", "cpu:0,cpu:0+0"])
    assert serve_config(ns).engine.device_ids == ("cpu:0", "cpu:0")


def test_the_threads_env_sets_worker_threads_when_the_flag_is_absent() -> None:
    ns = build_parser().parse_args(["serve"])
    assert serve_config(ns, {"TRIOSERVE_CPU_THREADS": "3"}).worker.worker_threads == 3
    flagged = build_parser().parse_args(["serve", "--worker-threads", "1"])
    assert serve_config(flagged, {"TRIOSERVE_CPU_THREADS": "3"}).worker.worker_threads == 1
    with pytest.raises(ValueError, match="TRIOSERVE_CPU_THREADS='0': expected a positive number"):
        serve_config(ns, {"TRIOSERVE_CPU_THREADS": "0"})


def test_thread_learning_is_set_by_flag_or_env_and_refused_where_it_cannot_run() -> None:
    def serve(*flags: str, env: dict[str, str] | None = None) -> ServeConfig:
        return serve_config(build_parser().parse_args(["serve", *flags]), env or {})

    assert serve().worker.cpu_adaptive_threads == 0
    assert serve(env={"TRIOSERVE_CPU_ADAPTIVE_THREADS": "2"}).worker.cpu_adaptive_threads == 2
    flagged = serve("--cpu-adaptive-threads", "1", env={"TRIOSERVE_CPU_ADAPTIVE_THREADS": "2"})
    assert flagged.worker.cpu_adaptive_threads == 1  # the flag wins
    with pytest.raises(ValueError, match="TRIOSERVE_CPU_ADAPTIVE_THREADS='3': expected 0, 1 or 2"):
        serve(env={"TRIOSERVE_CPU_ADAPTIVE_THREADS": "3"})
    with pytest.raises(ValueError, match="not for --engine mock"):
        serve("--engine", "mock", "--cpu-adaptive-threads", "1")
    with pytest.raises(ValueError, match="not with --device cuda"):
        serve("--device", "cuda", "--cpu-adaptive-threads", "1")
    with pytest.raises(ValueError, match="not with --tensor-parallel-size above 1"):
        serve("-tp", "2", "--cpu-adaptive-threads", "2")
    assert serve("--engine", "mock", "--cpu-adaptive-threads", "0").worker.cpu_adaptive_threads == 0


def test_an_engine_core_pins_itself_to_its_device() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    config = override(EngineProcessConfig(), device_ids=(f"cpu:{core}",), engine_index=0)
    try:
        place(config)
        assert os.sched_getaffinity(0) == {core}
        place(override(config, engine_index=1))  # no device for rank 1: left where it is
        assert os.sched_getaffinity(0) == {core}
    finally:
        os.sched_setaffinity(0, before)


def test_a_config_file_writes_the_same_configuration_as_the_flags(tmp_path: Path) -> None:
    """--config FILE and the flags build one tree; a flag given as well wins over the file."""
    cfg = tmp_path / "replicas.yaml"
    cfg.write_text(
        "replicas:\n  - device: cpu:0\n  - device: cpu:0\n"
        "outlier_detection:\n  consecutive_timeouts: 5\n  base_ejection_ms: 1000\n"
        "timeout_ms: 800\nkind: mock\n"
    )
    flags = [
        "serve", "--engine", "mock", "-dp", "2", "--device-ids", "cpu:0,cpu:0",
        "--consecutive-timeouts", "5", "--base-ejection-ms", "1000", "--request-timeout-ms", "800",
    ]  # fmt: skip
    from_flags = serve_config(build_parser().parse_args(flags))
    from_file = serve_config(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert from_file.supervisor.config_file == str(cfg.resolve())  # kept for a reload (SIGHUP)
    assert override(from_file, config_file=None) == from_flags
    over = serve_config(build_parser().parse_args(["serve", "--config", str(cfg), "--base-ejection-ms", "9"]))
    assert over.frontend.dispatch.base_ejection_ms == 9
    assert over.frontend.dispatch.consecutive_timeouts == 5


def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trioserve.cli import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text("replicas:\n  - device: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(cfg)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.yaml: replicas[0].device" in err, err
