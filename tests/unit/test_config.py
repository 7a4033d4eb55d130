"""The configuration tree's rules: one name per setting, overrides by name, a value that survives
the trip to a child process, and wrong types refused where the tree is built."""

from __future__ import annotations

import msgspec
import pytest

from trioserve.config import (
    EngineProcessConfig,
    HttpConfig,
    ServeConfig,
    StreamPolicy,
    decode_engine_process,
    encode,
    override,
    setting_names,
)


def test_no_setting_is_held_twice() -> None:
    names = setting_names(ServeConfig)
    assert names["max_num_seqs"] == ("engine",)
    assert names["port"] == ("frontend", "http")
    assert names["log_level"] == ()
    assert set(setting_names(EngineProcessConfig)) <= set(names)


class _TwoPorts(msgspec.Struct, frozen=True):
    http: HttpConfig = HttpConfig()
    port: int = 2


def test_a_name_held_twice_is_refused() -> None:
    with pytest.raises(TypeError, match="'port' is held by both"):
        setting_names(_TwoPorts)


def test_override_routes_flat_names_to_their_sections() -> None:
    base = ServeConfig()
    config = override(base, port=9000, max_num_seqs=8, mock_seed=3, log_level="debug")
    assert config.frontend.http.port == 9000
    assert config.engine.max_num_seqs == 8
    assert config.mock.mock_seed == 3
    assert config.log_level == "debug"
    # Everything else keeps its default; the original is untouched (frozen).
    assert config.frontend.admission == base.frontend.admission
    assert base.frontend.http.port == 8000


def test_override_refuses_unknown_names_and_wrong_types() -> None:
    with pytest.raises(TypeError, match="no setting named 'bogus'"):
        override(ServeConfig(), bogus=1)
    with pytest.raises(msgspec.ValidationError, match="port"):
        override(ServeConfig(), port="eighty")
    with pytest.raises(msgspec.ValidationError, match=r"`int` >= 1 - at `\$.engine.max_num_seqs`"):
        override(ServeConfig(), max_num_seqs=0)
    with pytest.raises(ValueError, match="stream_policy: queue:N needs N >= 1"):
        override(ServeConfig(), stream_policy="queue:0")
    with pytest.raises(msgspec.ValidationError, match="scheduling_policy"):
        override(ServeConfig(), scheduling_policy="lifo")


def test_the_engine_process_value_round_trips() -> None:
    config = override(ServeConfig(), kind="mock", step_interval_us=500, max_model_len=64, device="cpu")
    process = config.engine_process("ipc:///tmp/hs")
    back = decode_engine_process(encode(process))
    assert back == process
    assert back.engine.handshake_address == "ipc:///tmp/hs"
    assert (back.engine.kind, back.mock.step_interval_us, back.model.max_model_len) == ("mock", 500, 64)


def test_stream_policy_parses_its_setting() -> None:
    streams = override(ServeConfig(), stream_policy="queue:3", slow_client_max_tokens=9).frontend.streams
    assert streams.policy == StreamPolicy("queue", queue_events=3, slow_client_max_tokens=9)
    with pytest.raises(ValueError, match="queue:N needs N >= 1"):
        StreamPolicy.parse("queue:0")


def test_the_api_server_count_defaults_to_the_data_parallel_size() -> None:
    """vLLM's rule (docs/processes.md): --api-server-count 0 (the default) means -dp's value."""
    assert ServeConfig().api_server_count == 1 and not ServeConfig().supervised
    dp = override(ServeConfig(), data_parallel_size=3)
    assert dp.api_server_count == 3 and dp.supervised
    assert override(dp, api_server_count=1).api_server_count == 1
    assert override(ServeConfig(), api_server_count=2).supervised
