"""The one codec for every message that crosses a process boundary (msgpack via msgspec)."""

from __future__ import annotations

from typing import Union

import msgspec

from batonlm.ipc.device_messages import (
    BatchLaunch,
    BatchResult,
    IdleLaunch,
    LoRADrop,
    LoRALoad,
    LoRAPlace,
    SampleLaunch,
    WorkerAlive,
    WorkerFailed,
    WorkerProgress,
    WorkerReady,
    WorkerShutdown,
)
from batonlm.ipc.messages import (
    AbortRequest,
    BatchOutput,
    FlushCacheRequest,
    FlushCacheResult,
    GenerateRequest,
    LoadLoRARequest,
    LoRAResult,
    SchedulerFailed,
    SchedulerInfo,
    SchedulerStats,
    ShutdownRequest,
    StatsRequest,
    UnloadLoRARequest,
)

Message = Union[
    GenerateRequest,
    AbortRequest,
    StatsRequest,
    ShutdownRequest,
    FlushCacheRequest,
    FlushCacheResult,
    LoadLoRARequest,
    UnloadLoRARequest,
    LoRAResult,
    LoRADrop,
    LoRALoad,
    LoRAPlace,
    BatchOutput,
    SchedulerInfo,
    SchedulerStats,
    SchedulerFailed,
    BatchLaunch,
    IdleLaunch,
    SampleLaunch,
    BatchResult,
    WorkerAlive,
    WorkerFailed,
    WorkerProgress,
    WorkerReady,
    WorkerShutdown,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
