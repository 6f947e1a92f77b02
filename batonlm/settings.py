"""One declaration per setting.

A setting is a field of a frozen dataclass (`batonlm.config.ServerArgs`) whose metadata holds
everything else about it: its help, its group, its choices or bounds, how its default reads when
the default is "decided later" (None), extra flag names, and an environment variable that gives
its default. From that one declaration come the `batonlm serve` flags (`batonlm/cli.py`), the
YAML preset keys (`batonlm/config_file.py`), the value checks (`check_fields`), and the flag
tables of the docs (`batonlm/settings_docs.py`, checked by a test). Records another process needs
(`DeviceSpec`, `SchedulerConfig`, ...) take their plain values by name with `derive`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

_KEY = "batonlm.setting"


class ConfigError(ValueError):
    """A server argument is invalid; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# The flag groups of `batonlm serve --help`, in order: name -> what the group is about.
GROUPS: dict[str, str] = {
    "model": "which model is served, and as what",
    "device": "where the model runs, and the decode step (compiled on the CPU, CUDA graphs on a GPU)",
    "memory and scheduling": "KV cache, batching and the event loop",
    "request limits": "what one request may ask for (a 400 naming the field beyond)",
    "structured output and tools": "constrained decoding, tool calls and reasoning",
    "speculative decoding": "drafts verified in one step (n-grams or a draft model)",
    "parallelism": "tensor and data parallelism, several nodes (docs/distributed.md)",
    "http": "the listener, authentication, and the server's limits (docs/reliability.md)",
    "observability": "logging and debugging",
}


# How a limit measures the request fields it bounds (batonlm/server/limits.py).
MEASURES = ("count", "prompts", "each", "value")


@dataclass(frozen=True)
class Bound:
    """Request fields a setting bounds (at most the setting's value): "count" the items of a
    list or entries of an object (a lone string is one), "prompts" the prompts of a completions
    `prompt`, "each" the characters of each string, "value" an integer's value. `what` names
    what is counted ("stop strings"). The checks, the OpenAPI bounds and the docs read these."""

    fields: tuple[str, ...]
    measure: str
    what: str

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"unknown measure {self.measure!r}")


@dataclass(frozen=True)
class Setting:
    """What a field's type and default do not say."""

    group: str
    help: str
    choices: tuple[str, ...] | None = None
    ge: float | None = None  # bounds, inclusive (ge, le) or exclusive (gt, lt)
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    unit: str = ""  # of a number, in messages and tables ("seconds")
    unset: str | None = None  # what a None default means, shown as the default ("sized to memory")
    shown: str | None = None  # how the default reads, when its value alone says it badly ("4 MiB")
    flags: tuple[str, ...] = ()  # more names of the flag ("--tp" for tp_size)
    env: str | None = None  # an environment variable that gives the default
    metavar: str | None = None
    positional: bool = False  # `batonlm serve MODEL`
    bounds: Bound | None = None  # a request limit: the request fields it bounds

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"unknown settings group {self.group!r}")


def setting(default: Any = MISSING, *, default_factory: Callable[[], Any] | Any = MISSING, **meta: Any) -> Any:
    """A dataclass field declared with its `Setting` (keyword arguments). With `env`, the
    environment variable, when set, gives the default (parsed as the default's type)."""
    spec = Setting(**meta)
    if spec.env is not None:
        if default_factory is not MISSING:
            raise ValueError("a setting with env takes a plain default")
        default_factory = functools.partial(_from_env, spec.env, default)
        return field(default_factory=default_factory, metadata={_KEY: spec})
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={_KEY: spec})
    return field(default=default, metadata={_KEY: spec})


def _from_env(env: str, default: Any) -> Any:
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    kind = type(default) if default is not None else str
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(env.lower(), f"${env} must be {_KIND_WORDS[kind]}, got {raw!r}") from None


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Declared:
    """A setting as its dataclass field declares it."""

    name: str
    kind: type  # bool | int | float | str
    optional: bool  # None is a value (its meaning: `setting.unset`)
    setting: Setting
    default: Any  # MISSING: from a factory (`default_factory`)
    default_factory: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_value(self) -> Any:
        return self.default_factory() if self.default is MISSING else self.default

    def shown_default(self) -> str:
        """The default as `--help` and the docs show it."""
        s = self.setting
        if s.shown is not None:
            return s.shown
        value = self.default if self.default is not MISSING else None
        if s.env is not None:
            value = self.default_factory.args[1]  # the declared default, not the environment's
        if value is None:
            return s.unset or "none"
        if self.kind is bool:
            return "on" if value else "off"
        if self.kind is float and float(value).is_integer():
            value = int(value)
        return f"{value} {s.unit}".strip() if s.unit and self.kind is not str else str(value)

    def check(self, value: Any) -> None:
        """Raise ConfigError naming the field when `value` is not one this setting takes."""
        if value is None:
            if self.optional:
                return
            raise ConfigError(self.name, f"must be {self.describe()}, got None")
        if not _is_kind(value, self.kind) or (self.kind is float and not math.isfinite(value)):
            raise ConfigError(self.name, f"must be {self.describe()}, got {value!r}")
        s = self.setting
        if s.choices is not None and value not in s.choices:
            raise ConfigError(self.name, f"must be one of {', '.join(s.choices)}, got {value!r}")
        low_ok = (s.ge is None or value >= s.ge) and (s.gt is None or value > s.gt)
        high_ok = (s.le is None or value <= s.le) and (s.lt is None or value < s.lt)
        if not (low_ok and high_ok):
            raise ConfigError(self.name, f"must be {self.describe()}, got {value!r}")

    def describe(self) -> str:
        """What the setting takes, in words ("a positive integer", "in (0, 1)")."""
        s = self.setting
        if s.choices is not None:
            return "one of " + ", ".join(s.choices)
        kind = self.kind
        if kind not in (int, float):
            return _KIND_WORDS[kind]
        noun = "integer" if kind is int else "number"
        unit = f" of {s.unit}" if s.unit else ""
        low, high = s.ge if s.ge is not None else s.gt, s.le if s.le is not None else s.lt
        if high is not None and low is not None:
            left, right = "[" if s.ge is not None else "(", "]" if s.le is not None else ")"
            if kind is int:
                return f"in {_num(low)}..{_num(high)}"
            return f"in {left}{_num(low)}, {_num(high)}{right}"
        if (kind is int and s.ge == 1) or (kind is float and s.gt == 0):
            return f"a positive {noun}{unit}"
        if low is not None:
            return f"{'an' if kind is int else 'a'} {noun}{unit} {'>=' if s.ge is not None else '>'} {_num(low)}"
        if high is not None:
            return f"{'an' if kind is int else 'a'} {noun}{unit} {'<=' if s.le is not None else '<'} {_num(high)}"
        return f"{'an' if kind is int else 'a'} {noun}{unit}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """Every field of `cls` declared with `setting`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue
        kind, optional = _unwrap(hints[f.name])
        if kind not in _KIND_WORDS:
            raise TypeError(f"setting {f.name}: type {kind!r} is not bool, int, float or str")
        out.append(Declared(f.name, kind, optional, spec, f.default, f.default_factory))
    return tuple(out)


def _unwrap(hint: Any) -> tuple[type, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a setting's type is one type or None, got {hint!r}")
        return args[0], True
    return hint, False


def declared_by_name(cls: type) -> dict[str, Declared]:
    return {d.name: d for d in declared(cls)}


def check_fields(obj: Any) -> None:
    """Check every declared field of a settings dataclass instance (type, choices, bounds)."""
    cls: type = type(obj)  # as `type`: mypy takes type[Any] for unhashable (functools.cache's key)
    for d in declared(cls):
        d.check(getattr(obj, d.name))


def coerce(d: Declared, value: Any, where: str = "") -> Any:
    """A value from a file (YAML) as the field's type: integers are numbers, nothing else is
    converted. Raises ConfigError naming the field."""
    if value is None and d.optional:
        return None
    if d.kind is float and _is_kind(value, int):
        return float(value)
    if not _is_kind(value, d.kind):
        raise ConfigError(d.name, f"{where}expected {_KIND_WORDS[d.kind]}, got {value!r}")
    return value


def derive(cls: type, source: Any, prefix: str = "", **resolved: Any) -> Any:
    """An instance of the dataclass `cls` whose fields are `resolved`'s values, and for the rest
    the same-named attribute (`prefix + name`) of `source`: a record another process needs,
    built from the settings without copying them by hand. A field with neither must have a
    default in `cls` (a TypeError says which are missing otherwise)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in resolved:
            values[f.name] = resolved.pop(f.name)
        elif hasattr(source, prefix + f.name):
            values[f.name] = getattr(source, prefix + f.name)
    if resolved:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(resolved)}")
    return cls(**values)
