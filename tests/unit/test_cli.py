"""The command line builds the one typed config; bad flags are one line and exit code 2."""

from __future__ import annotations

from dataclasses import fields

import pytest

from trioserve.cli import build_parser, main, mock_engine_config, serve_config
from trioserve.config import MockEngineConfig, ServeConfig


@pytest.mark.parametrize(("command", "cls"), [("serve", ServeConfig), ("mock-engine", MockEngineConfig)])
def test_every_config_field_has_a_flag(command: str, cls: type) -> None:
    args = [command] + (["--handshake-address", "ipc:///x"] if command == "mock-engine" else [])
    ns = build_parser().parse_args(args)
    assert {f.name for f in fields(cls)} <= set(vars(ns))


def test_flags_reach_the_config() -> None:
    parser = build_parser()
    config = serve_config(
        parser.parse_args(
            ["serve", "--port", "9000", "--served-model-name", "a", "b", "--max-model-len", "64"]
        )
    )
    assert (config.port, config.served_model_name, config.max_model_len) == (9000, ("a", "b"), 64)
    assert config.model_names == ("a", "b")
    mock = mock_engine_config(parser.parse_args(["mock-engine", "--handshake-address", "x", "--seed", "4"]))
    assert (mock.handshake_address, mock.seed) == ("x", 4)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "notaport"],
        ["serve", "--bogus"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "--engine", "external"],
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
