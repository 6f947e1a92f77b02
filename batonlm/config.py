"""Server arguments: one frozen dataclass, validated at construction, passed down explicitly."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batonlm.registries import ATTENTION_BACKENDS, SAMPLERS

EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "assets" / "stories260K")
EMBEDDED_MODEL_NAME = "stories260K"

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# "auto" picks per device; the rest are the registries' names.
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS.names())
SAMPLER_CHOICES = ("auto", *SAMPLERS.names())


class ConfigError(ValueError):
    """A server argument is invalid; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ServerArgs:
    # Model
    model: str = EMBEDDED_MODEL
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_request_bytes: int = 4 * 1024 * 1024
    # Scheduling
    disable_overlap: bool = False
    max_running_requests: int = 128
    # The KV capacity in tokens (SGLang's flag name); None: sized to the device's memory.
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 16384
    enable_mixed_batch: bool = False
    random_seed: int = 0
    # Backends
    attention_backend: str = "auto"
    sampler: str = "auto"
    # CPU device: "process" (a worker process beside the scheduler) or "inline" (same process,
    # synchronous; for debugging only: nothing overlaps).
    cpu_device_worker: str = "process"
    # Intra-op threads of the CPU device worker (None: all cores but the scheduler's one).
    cpu_worker_threads: int | None = None
    mem_fraction_static: float = 0.85
    # Debugging
    debug_future_map: bool = False
    log_level: str = "info"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", EMBEDDED_MODEL)
        _choice("dtype", self.dtype, DTYPE_CHOICES)
        _choice("device", self.device, DEVICE_CHOICES)
        _choice("log_level", self.log_level, LOG_LEVELS)
        _choice("cpu_device_worker", self.cpu_device_worker, ("process", "inline"))
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKEND_CHOICES)
        _choice("sampler", self.sampler, SAMPLER_CHOICES)
        _positive("max_running_requests", self.max_running_requests)
        _positive("max_prefill_tokens", self.max_prefill_tokens)
        _positive("max_request_bytes", self.max_request_bytes)
        if self.max_total_tokens is not None:
            _positive("max_total_tokens", self.max_total_tokens)
        if self.context_length is not None:
            _positive("context_length", self.context_length)
        if self.cpu_worker_threads is not None:
            _positive("cpu_worker_threads", self.cpu_worker_threads)
        if not 0 < self.port < 65536:
            raise ConfigError("port", f"must be in 1..65535, got {self.port}")
        if not 0 < self.mem_fraction_static < 1:
            raise ConfigError("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        if self.extra:
            raise ConfigError(next(iter(self.extra)), "unknown server argument")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown server argument (known: {', '.join(sorted(known))})")
        return cls(**kwargs)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if os.path.realpath(self.model) == os.path.realpath(EMBEDDED_MODEL):
            return EMBEDDED_MODEL_NAME
        return self.model

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}, got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")
