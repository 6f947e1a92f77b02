"""YAML presets for `batonlm serve --config FILE`: server arguments by name, checked strictly."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from batonlm.config import ConfigError, ServerArgs

_NOT_FROM_FILES = {"extra"}


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(ServerArgs)
    return {f.name: hints[f.name] for f in dataclasses.fields(ServerArgs) if f.name not in _NOT_FROM_FILES}


def _coerce(key: str, value: Any, kind: Any) -> Any:
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kind = next(a for a in args if a is not type(None))
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(key, f"expected a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {value!r}")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Server arguments from a YAML file (keys may use dashes or underscores). Raises
    ConfigError naming the file and the offending key."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError("config", f"config file {str(p)!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{p} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{p} must hold a mapping of server arguments, got {type(data).__name__}")
    types_by_name = _field_types()
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in types_by_name:
            raise ConfigError(str(raw_key), f"unknown key in {p} (known: {', '.join(sorted(types_by_name))})")
        try:
            out[key] = _coerce(str(raw_key), value, types_by_name[key])
        except ConfigError as e:
            raise ConfigError(e.field, f"in {p}: {str(e).split(': ', 1)[1]}") from None
    try:  # values that are well-typed but out of range
        ServerArgs.from_kwargs(**out)
    except ConfigError as e:
        raise ConfigError(e.field, f"in {p}: {str(e).split(': ', 1)[1]}") from None
    return out
