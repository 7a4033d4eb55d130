"""The command line builds the one configuration tree; every setting has exactly one flag; bad flags
are one line and exit code 2."""

from __future__ import annotations

import argparse

import pytest

from trioserve.cli import build_parser, engine_process_config, main, serve_config
from trioserve.config import EngineProcessConfig, ServeConfig, setting_names


def _dests(parser: argparse.ArgumentParser) -> list[str]:
    return [a.dest for a in parser._actions if a.dest not in ("help", "config_json", "config_file")]


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def test_every_setting_has_one_flag_on_serve() -> None:
    dests = _dests(_subparser("serve"))
    assert len(dests) == len(set(dests)), "a flag defined twice"
    # Every setting has a flag but the engine's own rank and the headless launcher's (serve gives each
    # engine core its rank; --headless and its start rank are engine-core's; ``config_file`` is
    # --config's own path, which serve keeps for a reload).
    assert set(dests) == set(setting_names(ServeConfig)) - {
        "config_file",
        "engine_index",
        "headless",
        "data_parallel_start_rank",
    }


@pytest.mark.parametrize("command", ["engine-core", "mock-engine"])
def test_engine_core_flags_are_the_engine_settings(command: str) -> None:
    dests = _dests(_subparser(command))
    assert len(dests) == len(set(dests))
    # The names clients use and the tokenizer are the API server's alone; placement is serve's (it
    # starts the ranks; an engine core started by hand runs where it is started), and so is resizing.
    assert set(dests) == set(setting_names(EngineProcessConfig)) - {
        "served_model_name",
        "tokenizer",
        "device_ids",
        "max_data_parallel_size",
    }


def test_defaults_come_from_the_tree() -> None:
    """No flag has a default of its own: nothing given is the tree's default."""
    assert serve_config(build_parser().parse_args(["serve"])) == ServeConfig()
    core = engine_process_config(build_parser().parse_args(["engine-core", "--handshake-address", "x"]))
    # One default for --max-num-seqs whichever command reads it (it used to be 256 here, 1024 on serve).
    assert core.engine.max_num_seqs == ServeConfig().engine.max_num_seqs
    assert core.engine.kind == "reference"  # started by hand without --model


def test_flags_reach_the_config() -> None:
    parser = build_parser()
    config = serve_config(
        parser.parse_args(
            [
                "serve",
                "--port",
                "9000",
                "--served-model-name",
                "a",
                "b",
                "--max-model-len",
                "64",
                "--engine",
                "mock",
            ]
        )
    )
    assert (config.frontend.http.port, config.model.served_model_name, config.model.max_model_len) == (
        9000,
        ("a", "b"),
        64,
    )
    assert config.model.model_names == ("a", "b")
    assert config.engine.kind == "mock"
    mock = engine_process_config(
        parser.parse_args(["mock-engine", "--handshake-address", "x", "--mock-seed", "4"])
    )
    assert (mock.engine.handshake_address, mock.mock.mock_seed, mock.engine.kind) == ("x", 4, "mock")
    reference = serve_config(parser.parse_args(["serve", "--engine", "reference"]))
    assert reference.model.model_names == ("trioserve-reference",)
    named = serve_config(parser.parse_args(["serve", "/models/m", "--engine", "reference"]))
    assert named.model.model_names == ("/models/m",)


def test_max_logprobs_flag() -> None:
    parser = build_parser()
    default = serve_config(parser.parse_args(["serve"])).frontend.request
    assert default.max_logprobs == 20  # vLLM's default
    given = serve_config(parser.parse_args(["serve", "--max-logprobs", "5"])).frontend.request
    assert given.max_logprobs == 5


def test_serve_hands_the_engine_core_one_value() -> None:
    from trioserve.launch.serve import engine_command

    config = serve_config(build_parser().parse_args(["serve", "--engine", "mock", "--step-interval-us", "7"]))
    argv = engine_command(config, "ipc:///tmp/hs").argv
    assert argv[-2] == "engine-core" and argv[-1].startswith("--config-json=")
    ns = build_parser().parse_args(argv[-2:])
    assert engine_process_config(ns) == config.engine_process("ipc:///tmp/hs")


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "notaport"],
        ["serve", "--bogus"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "--engine", "external"],
        ["serve", "--stream-policy", "queue:0"],
        ["serve", "--port", "70000"],
        ["serve", "--kv-cache-gib", "0"],
        # Flags that would have no effect are refused (docs/processes.md, docs/remote_engines.md).
        ["serve", "--engine", "mock", "--dispatch", "prefix"],
        ["serve", "--engine", "mock", "--consecutive-timeouts", "5"],  # one replica is never ejected
        ["serve", "--engine", "mock", "-dp", "2", "--max-inflight-per-replica", "4"],  # not LOB
        ["serve", "--engine", "mock", "-tp", "2"],
        ["serve", "--engine", "mock", "-dp", "2", "--handshake-address", "tcp://127.0.0.1:7100"],
        ["engine-core", "--handshake-address", "ipc:///tmp/x", "--data-parallel-size-local", "2"],
        ["engine-core", "--handshake-address", "ipc:///tmp/x", "--data-parallel-start-rank", "1"],
        ["engine-core", "--config-json", "{}", "--block-size", "8"],
        ["engine-core", "--engine", "external", "--handshake-address", "x"],
        ["mock-engine"],
        [],
    ],
)
def test_bad_flags_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: Expected `int` >= 1"),
        (["serve", "--port", "70000"], "argument --port: Expected `int` <= 65535"),
        (["serve", "--stream-policy", "stall:2"], "stream_policy: unknown stream policy"),
        (["serve", "--max-ejection-percent", "10"], "argument --max-ejection-percent: it acts between"),
    ],
)
def test_a_refused_value_names_its_flag(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bounds live in the tree (config.py), once; the command line reports them by flag."""
    with pytest.raises(SystemExit):
        main(argv)
    assert names in capsys.readouterr().err
