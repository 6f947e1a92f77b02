"""YAML presets for `batonlm serve --config FILE`: server arguments by name, checked strictly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from batonlm.config import ServerArgs
from batonlm.settings import ConfigError, coerce, declared_by_name


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
    settings = declared_by_name(ServerArgs)
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in settings:
            raise ConfigError(str(raw_key), f"unknown key in {p} (known: {', '.join(sorted(settings))})")
        try:
            out[key] = coerce(settings[key], value, where=f"in {p}: ")
        except ConfigError as e:  # named as the file names it
            raise ConfigError(str(raw_key), str(e).split(": ", 1)[1]) from None
    try:  # values that are well-typed but out of range
        ServerArgs.from_kwargs(**out)
    except ConfigError as e:
        raise ConfigError(e.field, f"in {p}: {str(e).split(': ', 1)[1]}") from None
    return out
