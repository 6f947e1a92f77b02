"""The one place devices and their executors are built from a DeviceSpec."""

from __future__ import annotations

import logging

from batonlm.device.base import DeviceStream
from batonlm.device.batch_executor import BatchExecutor
from batonlm.device.future_map import FutureMap
from batonlm.device.spec import DeviceSpec
from batonlm.distributed.group import TPGroup
from batonlm.model_runner.decode_graphs import Progress
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import DTYPES
from batonlm.model_runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build_executor(
    spec: DeviceSpec, progress: Progress | None = None, tp: TPGroup | None = None, mlp_group: TPGroup | None = None
) -> BatchExecutor:
    """The model runner and FutureMap that execute launches, wherever the device is (with
    `tp`, this rank's part of the model); the decode step compiled (CPU) or captured (CUDA) as
    the spec says, with `progress` told of each step of that (it takes a while)."""
    if spec.compile_max_bs:
        from batonlm.model_runner.compiled_decode import probe_vector_isa_early

        probe_vector_isa_early()
    cfg = ModelConfig.from_hf(spec.model_path, spec.model_impl, spec.quantization)
    device = spec.rank_device(tp.rank if tp is not None else 0)
    runner = ModelRunner(
        cfg,
        dtype=DTYPES[spec.dtype],
        device=device,
        tp=tp,
        mlp_group=mlp_group,
        kv_capacity=spec.kv_capacity,
        num_req_slots=spec.num_req_slots,
        context_length=spec.context_length,
        attention_backend=spec.attention_backend,
        sampler=spec.sampler,
        kv_cache=spec.kv_cache_dtype,
    )
    if spec.lora_slots:
        runner.use_lora(spec.lora_slots, spec.lora_rank, spec.lora_adapters)
    progress = progress or logger.info
    if spec.compile_max_bs:
        from batonlm.model_runner.compiled_decode import CompiledDecode

        runner.use_decode_graphs(CompiledDecode(
            runner.model, runner.attn, max_bs=spec.compile_max_bs, max_context=spec.context_length,
            cache_dir=spec.compile_cache_dir, lora=runner.lora,
        ), progress)
    elif spec.cuda_graph_max_bs:
        from batonlm.model_runner.cuda_graph_decode import CudaGraphDecode

        runner.use_decode_graphs(CudaGraphDecode(runner, max_bs=spec.cuda_graph_max_bs), progress)
    draft = None
    if spec.draft_model_path is not None:
        draft_cfg = ModelConfig.from_hf(spec.draft_model_path)
        if draft_cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) differs from the model's "
                             f"({cfg.vocab_size}): they must share the tokenizer")
        # Its own KV pool with the same slot numbering: the scheduler's slots serve both. Not
        # split under tensor parallelism: every rank runs the whole (small) draft model.
        draft = ModelRunner(draft_cfg, dtype=DTYPES[spec.dtype], device=device, kv_capacity=spec.kv_capacity,
                            num_req_slots=spec.num_req_slots, context_length=spec.context_length,
                            attention_backend=spec.attention_backend, sampler=spec.sampler,
                            kv_cache=spec.kv_cache_dtype)
    return BatchExecutor(runner, FutureMap(spec.num_req_slots, runner.device, debug=spec.debug_future_map), draft)


def create_device(spec: DeviceSpec) -> DeviceStream:
    """The device that runs launches: a CUDA stream, a CPU worker process, (debugging) the
    caller's own process, or (host measurements, `--device null`) nothing at all."""
    if spec.tp_size > 1 or spec.dp_size > 1:  # a worker process per rank, on the CPU or a GPU each
        from batonlm.device.cpu_worker import CpuWorkerDevice

        return CpuWorkerDevice(spec)
    if spec.device == "null":
        from batonlm.device.null import NullDevice

        return NullDevice(spec)
    if spec.device.startswith("cuda"):
        from batonlm.device.cuda_stream import CudaDevice

        return CudaDevice(spec)
    if spec.cpu_device_worker == "inline":
        from batonlm.device.inline import InlineDevice

        return InlineDevice(spec)
    from batonlm.device.cpu_worker import CpuWorkerDevice

    return CpuWorkerDevice(spec)
