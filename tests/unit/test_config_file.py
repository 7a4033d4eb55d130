"""``serve --config FILE``: each document form gives the flat settings the flags give, the forms agree
with each other, ``override`` takes the result, and every mistake names the file and the key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from trioserve.config import ServeConfig, override, setting_names
from trioserve.config_file import (
    ConfigFileError,
    load_config_file,
    settings_from_document,
)

# Seed 002's own example ("Eject a replica that keeps timing out"), its devices made CPU ones.
SEED_EXAMPLE = """\
global:
model_catalog:
deployments:
  primary:
    provider: model_runtime
    artifact: vllm-sr/Vela-2.0-4B
    replicas:
      - device: cpu:0
      - device: cpu:1
    outlier_detection:
      consecutive_timeouts: 3 # default 3; 0 turns ejection off
      base_ejection_ms: 30000 # default 30000
      max_ejection_ms: 300000 # default ten times the base, at most an hour
      max_ejection_percent: 50 # default 50
"""
SEED_SETTINGS = {
    "model": "vllm-sr/Vela-2.0-4B",
    "data_parallel_size": 2,
    "device_ids": ("cpu:0", "cpu:1"),
    "consecutive_timeouts": 3,
    "base_ejection_ms": 30000,
    "max_ejection_ms": 300000,
    "max_ejection_percent": 50,
}


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error(doc: object) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as info:
        settings_from_document(doc, source="cfg.yaml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("cfg.yaml: ")
    return info.value


# ---------------------------------------------------------------------------------------- the seed


def test_the_seeds_example_gives_its_replicas_and_outlier_settings(tmp_path: Path) -> None:
    settings = load_config_file(write(tmp_path, SEED_EXAMPLE))
    assert settings == SEED_SETTINGS
    config = override(ServeConfig(), **settings)
    assert config.engine.data_parallel_size == 2
    assert config.engine.device_ids == ("cpu:0", "cpu:1")
    assert config.model.model == "vllm-sr/Vela-2.0-4B"
    dispatch = config.frontend.dispatch
    assert (dispatch.consecutive_timeouts, dispatch.base_ejection_ms) == (3, 30000)
    assert (dispatch.max_ejection_ms, dispatch.max_ejection_percent) == (300000, 50)


def test_flat_top_level_and_nested_forms_give_the_same_settings() -> None:
    flat = {
        "model": "m",
        "data_parallel_size": 2,
        "device_ids": ["cpu:0", "cpu:1"],
        "consecutive_timeouts": 5,
        "base_ejection_ms": 1000,
        "request_timeout_ms": 250,
    }
    top = {
        "model": "m",
        "replicas": [{"device": "cpu:0"}, {"device": "cpu:1"}],
        "outlier_detection": {"consecutive_timeouts": 5, "base_ejection_ms": 1000},
        "timeout_ms": 250,
    }
    nested = {
        "deployments": {
            "primary": {
                "model": "m",
                "replicas": [{"device": "cpu:0"}, {"device": "cpu:1"}],
                "outlier_detection": {"consecutive_timeouts": 5, "base_ejection_ms": 1000},
                "timeout_ms": 250,
            }
        }
    }
    expected = {**flat, "device_ids": ("cpu:0", "cpu:1")}
    assert settings_from_document(flat) == expected
    assert settings_from_document(top) == expected
    assert settings_from_document(nested) == expected
    override(ServeConfig(), **expected)


@given(
    devices=st.lists(st.sampled_from(["cpu:0", "cpu:1", "cpu:0-1", "cuda:0"]), min_size=1, max_size=4),
    named=st.booleans(),
    outlier=st.dictionaries(
        st.sampled_from(["consecutive_timeouts", "max_ejection_percent"]), st.integers(0, 9)
    ),
    dashes=st.booleans(),
)
def test_every_form_agrees_and_survives_a_trip_through_yaml(
    devices: list[str], named: bool, outlier: dict[str, int], dashes: bool
) -> None:
    """For any replica list: the seed's forms, the flat form (with dashes or not) and the same document
    written out as YAML give one dict, and ``override`` accepts it."""

    def key(name: str) -> str:
        return name.replace("_", "-") if dashes else name

    replicas = [{"device": d} if named else {} for d in devices]
    flat: dict[str, Any] = {
        key("data_parallel_size"): len(devices),
        **{key(k): v for k, v in outlier.items()},
    }
    if named:
        flat[key("device_ids")] = ",".join(devices)
    top = {"replicas": replicas, "outlier_detection": outlier}
    nested = {"deployments": {"d": top}, "global": None}
    results = [settings_from_document(doc) for doc in (flat, top, nested)]
    results.append(settings_from_document(yaml.safe_load(yaml.safe_dump(nested))))
    assert all(r == results[0] for r in results)
    assert results[0]["data_parallel_size"] == len(devices)
    assert results[0].get("device_ids") == (tuple(devices) if named else None)
    override(ServeConfig(), **results[0])


# ------------------------------------------------------------------------------------ flat settings


def test_flat_settings_take_dashes_and_tuples() -> None:
    settings = settings_from_document(
        {
            "max-num-seqs": 64,
            "port": 9000,
            "dispatch": "least-outstanding-bytes",
            "max_inflight_per_replica": 8,
            "served_model_name": ["a", "b"],
            "api_key": "secret",
            "allowed-origins": ["https://a.example"],
        }
    )
    assert settings == {
        "max_num_seqs": 64,
        "port": 9000,
        "dispatch": "least-outstanding-bytes",
        "max_inflight_per_replica": 8,
        "served_model_name": ("a", "b"),
        "api_key": ("secret",),
        "allowed_origins": ("https://a.example",),
    }
    config = override(ServeConfig(), **settings)
    assert config.engine.max_num_seqs == 64
    assert config.model.served_model_name == ("a", "b")
    assert config.frontend.access.api_key == ("secret",)


def test_device_ids_as_a_string_or_a_list() -> None:
    assert settings_from_document({"device_ids": "cpu:0-1, cpu:2+4,"}) == {
        "device_ids": ("cpu:0-1", "cpu:2+4")
    }
    assert settings_from_document({"device-ids": ["cuda:0", " cuda:1"]}) == {
        "device_ids": ("cuda:0", "cuda:1")
    }
    assert "device_ids[1]" in str(error({"device_ids": ["cpu:0", 3]}))
    assert "device_ids[0]" in str(error({"device_ids": ["cpu:0,cpu:1"]}))


def test_values_are_passed_on_for_override_to_check() -> None:
    """Shape only here: a wrong type reaches ``override``, which refuses it as it would a flag's."""
    settings = settings_from_document({"max_num_seqs": "many", "timeout_ms": -1})
    assert settings == {"max_num_seqs": "many", "request_timeout_ms": -1}
    with pytest.raises(msgspec.ValidationError):
        override(ServeConfig(), **settings)


def test_the_top_level_forms_use_no_setting_name() -> None:
    """`replicas`, `deployments`, ... are never settings too, so no key means two things."""
    names = setting_names(ServeConfig)
    assert not {
        "replicas",
        "outlier_detection",
        "timeout_ms",
        "deployments",
        "global",
        "model_catalog",
    } & set(names)


def test_a_setting_given_twice_with_the_same_value_is_fine() -> None:
    doc = {
        "max_num_seqs": 4,
        "max-num-seqs": 4,
        "data_parallel_size": 2,
        "replicas": [{}, {}],
        "model": "m",
        "deployments": {"p": {"artifact": "m", "model": "m", "timeout_ms": 5}},
        "request_timeout_ms": 5,
    }
    assert settings_from_document(doc) == {
        "max_num_seqs": 4,
        "data_parallel_size": 2,
        "model": "m",
        "request_timeout_ms": 5,
    }


# ----------------------------------------------------------------------------------------- files


def test_an_empty_file_gives_no_settings(tmp_path: Path) -> None:
    assert load_config_file(write(tmp_path, "")) == {}
    assert load_config_file(str(write(tmp_path, "# nothing\n"))) == {}


def test_bad_yaml_is_one_line_naming_the_file_and_place(tmp_path: Path) -> None:
    path = write(tmp_path, "replicas: [\n  - device: cpu:0\nport: {\n")
    with pytest.raises(ConfigFileError) as info:
        load_config_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not valid YAML at line ") and "\n" not in message


def test_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match=r"missing\.yaml: cannot read it"):
        load_config_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigFileError, match="cannot read it"):
        load_config_file(tmp_path)  # a folder
    (tmp_path / "latin1.yaml").write_bytes(b"model: caf\xe9\n")
    with pytest.raises(ConfigFileError, match=r"latin1\.yaml: cannot read it"):
        load_config_file(tmp_path / "latin1.yaml")


def test_errors_from_a_file_name_it(tmp_path: Path) -> None:
    path = write(
        tmp_path, "deployments:\n  primary:\n    replicas:\n      - device: cpu:0\n      - device: 1\n"
    )
    with pytest.raises(ConfigFileError) as info:
        load_config_file(path)
    assert str(info.value).startswith(f"{path}: deployments.primary.replicas[1].device: a device id is")
    assert info.value.source == str(path)
    assert info.value.key_path == "deployments.primary.replicas[1].device"


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("doc", "key_path", "words"),
    [
        # The document itself.
        (["port: 1"], "", "expected a mapping of settings at the top, got a list"),
        ("port", "", "expected a mapping"),
        ({True: 1}, "True", "a key must be a name"),
        # Unknown keys, with a suggestion.
        ({"max_num_seq": 1}, "max_num_seq", "did you mean max_num_seqs?"),
        ({"frobnicate": 1}, "frobnicate", "expected a setting"),
        ({"outlier_detection": {"consecutive": 1}}, "outlier_detection.consecutive", "unknown key"),
        ({"replicas": [{"gpu": "cuda:0"}]}, "replicas[0].gpu", "expected device"),
        ({"deployments": {"p": {"max_num_seqs": 4}}}, "deployments.p.max_num_seqs", "unknown key"),
        # Replicas.
        ({"replicas": []}, "replicas", "non-empty list"),
        ({"replicas": {"device": "cpu:0"}}, "replicas", "got a mapping"),
        ({"replicas": ["cpu:0"]}, "replicas[0]", "expected a mapping"),
        ({"replicas": [{"device": ["cpu:0"]}]}, "replicas[0].device", "a device id is a string"),
        ({"replicas": [{"device": "cpu:0,cpu:1"}]}, "replicas[0].device", "one device id"),
        ({"replicas": [{"device": " "}]}, "replicas[0].device", "one device id"),
        ({"replicas": [{"device": "cpu:0"}, {}]}, "replicas[1]", "either every replica names one"),
        ({"replicas": [{}, {"device": "cpu:0"}]}, "replicas[0]", "either every replica names one"),
        ({"outlier_detection": [3]}, "outlier_detection", "expected a mapping"),
        # Deployments.
        ({"deployments": {"a": {}, "b": {}}}, "deployments", "one model per server"),
        ({"deployments": {}}, "deployments", "exactly one deployment, got none"),
        ({"deployments": None}, "deployments", "exactly one deployment"),
        ({"deployments": ["p"]}, "deployments", "expected a mapping"),
        ({"deployments": {1: {}}}, "deployments.1", "a deployment name must be a string"),
        ({"deployments": {"p": ["x"]}}, "deployments.p", "expected a mapping"),
        (
            {"deployments": {"p": {"provider": "vllm"}}},
            "deployments.p.provider",
            "only provider model_runtime",
        ),
        ({"global": {"port": 1}}, "global", "not supported"),
        ({"model_catalog": ["m"]}, "model_catalog", "not supported"),
        # Conflicts.
        ({"data_parallel_size": 3, "replicas": [{}, {}]}, "replicas", "already set it to 3"),
        ({"replicas": [{}, {}], "data-parallel-size": 3}, "data-parallel-size", "already set it to 2"),
        ({"max_num_seqs": 1, "max-num-seqs": 2}, "max-num-seqs", "sets max_num_seqs to 2"),
        (
            {"device_ids": "cpu:0,cpu:2", "replicas": [{"device": "cpu:0"}, {"device": "cpu:1"}]},
            "replicas",
            "sets device_ids",
        ),
        ({"timeout_ms": 1, "request_timeout_ms": 2}, "request_timeout_ms", "timeout_ms already set it"),
        ({"deployments": {"p": {"artifact": "a", "model": "b"}}}, "deployments.p.model", "already set it"),
        ({"model": "a", "deployments": {"p": {"artifact": "b"}}}, "deployments.p.artifact", "already set it"),
        (
            {
                "consecutive_timeouts": 1,
                "deployments": {"p": {"outlier_detection": {"consecutive-timeouts": 2}}},
            },
            "deployments.p.outlier_detection.consecutive-timeouts",
            "consecutive_timeouts already set it to 1",
        ),
    ],
)
def test_every_mistake_names_its_key_path(doc: object, key_path: str, words: str) -> None:
    err = error(doc)
    assert err.key_path == key_path
    if key_path:
        assert str(err).startswith(f"cfg.yaml: {key_path}: ")
    assert words in str(err)


def test_the_unknown_key_message_lists_what_is_accepted() -> None:
    message = str(error({"deployments": {"p": {"weights": "x"}}}))
    for field in ("replicas", "outlier_detection", "timeout_ms", "artifact", "model", "provider"):
        assert field in message
    assert "deployments" in str(error({"colour": 1}))
