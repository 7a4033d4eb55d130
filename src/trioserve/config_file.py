"""The configuration file of ``trioserve serve --config FILE`` (YAML): the same settings as the flags.

A file is read into the flat ``name -> value`` dict the command line builds (the names of
``setting_names(ServeConfig)``: ``max_num_seqs``, ``device_ids``, ...). ``cli.py`` merges it under the
flags, a flag winning, and hands the result to ``override(ServeConfig(), ...)``: one configuration, and
nothing here holds a second copy of it.

A document is a mapping, in any mix of three forms:

- flat settings: ``max_num_seqs: 64``, with dashes allowed for underscores (``max-num-seqs``). A list
  for a tuple setting (``served_model_name``, ``api_key``, ...) becomes a tuple, and so does one
  string; ``device_ids`` is a list of ids or one comma-separated string;
- seed 002's replica fields: ``replicas:`` (a non-empty list of ``{device: ID}``, either every one naming
  its device or none) gives ``data_parallel_size`` and ``device_ids``; ``outlier_detection:`` gives
  ``consecutive_timeouts``, ``base_ejection_ms``, ``max_ejection_ms`` and ``max_ejection_percent``;
  ``timeout_ms`` gives ``request_timeout_ms``;
- seed 002's nested form: ``deployments:`` with exactly one deployment (a server serves one model),
  whose body holds the replica fields above, ``artifact`` or ``model`` (the model folder) and
  ``provider`` (only ``model_runtime``); ``global:`` and ``model_catalog:`` are accepted only empty.

Rules:

- Shape only: which keys, lists and mappings. A value's type and range are ``override``'s to check,
  exactly as for a flag's.
- A setting given twice (in two forms, or once with dashes and once without) must be given the same
  value both times; different values are an error, never "the last one wins".
- Every mistake is a ``ConfigFileError`` with a one-line message naming the file and the key path
  (``cfg.yaml: deployments.primary.replicas[1].device: ...``).

This module imports no trio, zmq or torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from trioserve.config import ServeConfig, setting_names

# ``config_file`` is where the file itself is (cli.py sets it): not a setting a file can hold.
_SETTINGS = {name: path for name, path in setting_names(ServeConfig).items() if name != "config_file"}


def _tuple_settings() -> frozenset[str]:
    """Settings whose value is a tuple, read off their defaults."""
    defaults = ServeConfig()
    out: set[str] = set()
    for name, path in _SETTINGS.items():
        section: Any = defaults
        for part in path:
            section = getattr(section, part)
        if isinstance(getattr(section, name), tuple):
            out.add(name)
    return frozenset(out)


_TUPLES = _tuple_settings()
_OUTLIER_FIELDS = ("consecutive_timeouts", "base_ejection_ms", "max_ejection_ms", "max_ejection_percent")
_REPLICA_FIELDS = ("replicas", "outlier_detection", "timeout_ms")
_DEPLOYMENT_FIELDS = (*_REPLICA_FIELDS, "artifact", "model", "provider")
_TOP_FIELDS = (*_REPLICA_FIELDS, "deployments", "global", "model_catalog")
_PROVIDER = "model_runtime"


class ConfigFileError(ValueError):
    """A file that cannot be read or does not describe a configuration. ``source``: the file;
    ``key_path``: where in it (``""``: the whole file); the message is one line naming both."""

    def __init__(self, source: str, key_path: str, reason: str) -> None:
        self.source = source
        self.key_path = key_path
        self.reason = " ".join(reason.split())  # one line, whatever the reason quotes
        super().__init__(f"{source}: {key_path}: {self.reason}" if key_path else f"{source}: {self.reason}")


class _Collected:
    """The settings found so far, and the key path that gave each (for the message of a conflict)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.given_by: dict[str, str] = {}

    def error(self, key_path: str, reason: str) -> ConfigFileError:
        return ConfigFileError(self.source, key_path, reason)

    def put(self, name: str, value: Any, key_path: str) -> None:
        if name in self.values and self.values[name] != value:
            raise self.error(
                key_path,
                f"sets {name} to {value!r}, but {self.given_by[name]} already set it to "
                f"{self.values[name]!r}",
            )
        self.values.setdefault(name, value)
        self.given_by.setdefault(name, key_path)


def _join(key_path: str, key: object) -> str:
    return f"{key_path}.{key}" if key_path else str(key)


def _mapping(c: _Collected, value: object, key_path: str, what: str) -> dict[Any, Any]:
    """``value`` as a mapping; an empty key (``outlier_detection:``) is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise c.error(key_path, f"expected {what}, got {_kind(value)}")
    return value


def _kind(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _items(
    c: _Collected, mapping: dict[Any, Any], key_path: str, accepted: tuple[str, ...], settings: bool = False
) -> list[tuple[str, str, Any]]:
    """``(name, key path, value)`` per key, each name with underscores for dashes. A key that is not a
    string, or neither one of ``accepted`` nor (with ``settings``) a setting's name, is an error."""
    out: list[tuple[str, str, Any]] = []
    for key, value in mapping.items():
        here = _join(key_path, key)
        if not isinstance(key, str):  # YAML 1.1 reads `on:`, `yes:` and `1:` as bool and int keys
            raise c.error(here, f"a key must be a name, got {type(key).__name__} {key!r}")
        name = key.replace("-", "_")
        if name not in accepted and not (settings and name in _SETTINGS):
            raise c.error(here, _unknown(key, accepted, settings))
        out.append((name, here, value))
    return out


def _unknown(key: str, accepted: tuple[str, ...], settings: bool) -> str:
    pool = [*accepted, *(_SETTINGS if settings else ())]
    close = difflib.get_close_matches(key.replace("-", "_"), pool, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    listed = ", ".join(accepted)
    if settings:
        listed = f"a setting (a flag's name, such as max_num_seqs) or {listed}"
    return f"unknown key {key!r}{hint}; expected {listed}"


def _device_list(c: _Collected, value: object, key_path: str) -> object:
    """``device_ids``: one comma-separated string, or a list with one device id per entry."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if not isinstance(value, list):
        return value  # override refuses it
    for index, device in enumerate(value):
        _device(c, device, f"{key_path}[{index}]")
    return tuple(d.strip() for d in value)


def _device(c: _Collected, device: object, key_path: str) -> str:
    if not isinstance(device, str):
        raise c.error(key_path, f"a device id is a string such as cpu:0-3 or cuda:0, got {_kind(device)}")
    if not device.strip() or "," in device:
        raise c.error(key_path, f"expected one device id such as cpu:0-3 or cuda:0, got {device!r}")
    return device.strip()


def _setting(c: _Collected, name: str, value: object, key_path: str) -> None:
    if name == "device_ids":
        value = _device_list(c, value, key_path)
    elif name in _TUPLES and isinstance(value, list):
        value = tuple(value)
    elif name in _TUPLES and isinstance(value, str):
        value = (value,)
    c.put(name, value, key_path)


def _replicas(c: _Collected, value: object, key_path: str) -> None:
    if not isinstance(value, list) or not value:
        raise c.error(key_path, f"expected a non-empty list of replicas ({{device: ID}}), got {_kind(value)}")
    devices: list[str | None] = []
    for index, replica in enumerate(value):
        here = f"{key_path}[{index}]"
        fields = _items(c, _mapping(c, replica, here, "a mapping such as {device: cpu:0}"), here, ("device",))
        device = None
        for _, at, given in fields:  # only `device` is accepted
            device = _device(c, given, at)
        devices.append(device)
    c.put("data_parallel_size", len(devices), key_path)
    named = [d for d in devices if d is not None]
    if named and len(named) != len(devices):
        first_missing = devices.index(None)
        raise c.error(
            f"{key_path}[{first_missing}]", "names no device: either every replica names one or none does"
        )
    if named:
        c.put("device_ids", tuple(named), key_path)


def _outlier_detection(c: _Collected, value: object, key_path: str) -> None:
    block = _mapping(c, value, key_path, "a mapping of " + ", ".join(_OUTLIER_FIELDS))
    for name, here, field in _items(c, block, key_path, _OUTLIER_FIELDS):
        c.put(name, field, here)


def _replica_field(c: _Collected, name: str, value: object, key_path: str) -> None:
    """One of ``replicas``, ``outlier_detection``, ``timeout_ms``: at the top or in a deployment."""
    if name == "replicas":
        _replicas(c, value, key_path)
    elif name == "outlier_detection":
        _outlier_detection(c, value, key_path)
    else:
        c.put("request_timeout_ms", value, key_path)


def _deployments(c: _Collected, value: object, key_path: str) -> None:
    deployments = _mapping(c, value, key_path, "a mapping of one deployment name to its fields")
    if len(deployments) != 1:
        names = ", ".join(repr(k) for k in deployments) or "none"
        raise c.error(
            key_path,
            f"expected exactly one deployment, got {names}: trioserve serves one model per server "
            "(start a server per model)",
        )
    ((name, body),) = deployments.items()
    here = _join(key_path, name)
    if not isinstance(name, str):
        raise c.error(here, f"a deployment name must be a string, got {type(name).__name__} {name!r}")
    fields = _mapping(c, body, here, "a mapping of " + ", ".join(_DEPLOYMENT_FIELDS))
    for field, at, field_value in _items(c, fields, here, _DEPLOYMENT_FIELDS):
        if field in _REPLICA_FIELDS:
            _replica_field(c, field, field_value, at)
        elif field == "provider":
            if field_value != _PROVIDER:
                raise c.error(at, f"only provider {_PROVIDER} is supported (trioserve runs the model itself)")
        else:  # artifact, model: the model folder
            c.put("model", field_value, at)


def _empty_only(c: _Collected, value: object, key_path: str) -> None:
    if value not in (None, {}, []):
        raise c.error(key_path, "not supported: trioserve takes one deployment; leave it empty or remove it")


_TOP: dict[str, Callable[[_Collected, object, str], None]] = {
    "deployments": _deployments,
    "global": _empty_only,
    "model_catalog": _empty_only,
}


def settings_from_document(doc: object, source: str = "config") -> dict[str, Any]:
    """The flat settings ``doc`` (a parsed YAML document) gives; ``source`` names it in errors. An
    empty document (``None``) gives none."""
    c = _Collected(source)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise c.error("", f"expected a mapping of settings at the top, got {_kind(doc)}")
    for name, key_path, value in _items(c, doc, "", _TOP_FIELDS, settings=True):
        # A setting's own name comes first: `model` at the top is the setting, as on the command line.
        if name in _SETTINGS:
            _setting(c, name, value, key_path)
        elif name in _REPLICA_FIELDS:
            _replica_field(c, name, value, key_path)
        else:
            _TOP[name](c, value, key_path)
    return dict(c.values)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The flat settings the YAML file at ``path`` gives (``settings_from_document``). A file that
    cannot be read, or is not YAML, is a ``ConfigFileError`` too."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigFileError(source, "", f"cannot read it: {reason}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigFileError(source, "", f"not valid YAML{where}: {problem}") from None
    return settings_from_document(doc, source)
