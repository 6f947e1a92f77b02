"""Build the device-side objects (ModelRunner + FutureMap) from a DeviceSpec."""

from __future__ import annotations

from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import DTYPES
from batonlm.model_runner.model_runner import ModelRunner
from batonlm.scheduler.batch_executor import BatchExecutor
from batonlm.scheduler.device.base import DeviceSpec
from batonlm.scheduler.future_map import FutureMap


def build_executor(spec: DeviceSpec) -> BatchExecutor:
    cfg = ModelConfig.from_hf(spec.model_path)
    runner = ModelRunner(
        cfg,
        dtype=DTYPES[spec.dtype],
        device=spec.device,
        num_kv_slots=spec.num_kv_slots,
        num_req_slots=spec.num_req_slots,
        context_length=spec.context_length,
        attention_backend=spec.attention_backend,
        sampler=spec.sampler,
    )
    return BatchExecutor(runner, FutureMap(spec.num_req_slots, runner.device, debug=spec.debug_future_map))
