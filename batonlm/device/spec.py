"""DeviceSpec: what the device side is built from, and how it is chosen and sized from the
server arguments and the model (backends, dtype, KV capacity, request slots)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from batonlm.config import CUDA_GRAPH_MAX_BS, ServerArgs
from batonlm.device import cpu_affinity
from batonlm.kernels.toolchain import cache_root, cxx_compiler
from batonlm.model_runner.decode_graphs import COMPILE_MAX_BS
from batonlm.model_runner.kv_pool import KVPool, kv_cache_dtype
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import DTYPES, resolve_dtype, tp_layout
from batonlm.model_runner.weight_size import weight_bytes
from batonlm.settings import derive

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSpec:
    """What the device side needs to build its ModelRunner (sent to a worker at spawn). Fields
    named like a server argument are that argument (`device_spec` derives them); the rest are
    resolved from the arguments and the model."""

    model_path: str
    dtype: str  # float32 | bfloat16 | float16 (resolved)
    device: str  # cpu | cuda[:n]
    kv_capacity: int  # usable KV slots (tokens); the pool has one more, slot 0 (padding)
    num_req_slots: int
    context_length: int
    attention_backend: str
    sampler: str
    debug_future_map: bool = False
    model_impl: str = "native"  # or transformers (resolved by ModelConfig.from_hf)
    quantization: str = "auto"  # --quantization (ModelConfig.from_hf resolves it)
    cpu_threads: int = 1  # intra-op threads of the CPU device worker
    worker_cpus: tuple[int, ...] = ()  # the cores the CPU device worker keeps (cpu_affinity.py; none: any)
    null_step_ms: float = 0.0  # --device null: the modelled time of a device step
    cpu_device_worker: str = "process"  # CPU only: "process" (a worker process) or "inline" (debugging)
    # The decode step (decode_graphs.py): CPU, compiled for batches up to compile_max_bs (0: eager);
    # CUDA, captured as graphs for batches up to cuda_graph_max_bs (0: eager).
    compile_max_bs: int = 0
    compile_cache_dir: str = ""
    cuda_graph_max_bs: int = 0
    # The KV pool's storage: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (kv_pool.py).
    kv_cache_dtype: str = "auto"
    draft_model_path: str | None = None  # speculative decoding's draft model (its own KV pool)
    # LoRA: the device's adapter slots (0: off), their rank, and the --lora-paths adapters (name,
    # directory) held as loads 1.. in order.
    lora_slots: int = 0
    lora_rank: int = 0
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # Tensor parallelism (batonlm/distributed/): `tp_size` rank processes meeting at
    # `dist_init_addr`; this node runs `local_ranks`.
    tp_size: int = 1
    local_ranks: tuple[int, ...] = (0,)
    dist_init_addr: str = ""
    dist_timeout: float = 120.0  # seconds
    debug_tp_check_every: int = 0
    # DP attention: this replica is data-parallel rank `dp_rank` of `dp_size` whose devices run
    # every MLP together (a group meeting at `dp_init_method`); 1 without DP attention.
    dp_size: int = 1
    dp_rank: int = 0
    dp_init_method: str = ""

    def rank_device(self, rank: int) -> str:
        """The device a tensor-parallel rank computes on: its node's GPU of the same local index
        (counted from this replica's first GPU, `device`)."""
        if self.tp_size == 1 or not self.device.startswith("cuda"):
            return self.device
        first = int(self.device.partition(":")[2] or 0)
        return f"cuda:{first + rank - self.local_ranks[0]}"


# KV memory the CPU device may use when --max-total-tokens is not given.
CPU_KV_BUDGET_BYTES = 2 * 1024**3


class DeviceConfigError(ValueError):
    pass


def context_length(args: ServerArgs, cfg: ModelConfig) -> int:
    if args.context_length is None:
        return cfg.context_length
    if args.context_length > cfg.context_length:
        raise DeviceConfigError(
            f"context_length {args.context_length} exceeds the model's max_position_embeddings {cfg.context_length}"
        )
    return args.context_length


def _kv_capacity(args: ServerArgs, cfg: ModelConfig, dtype: torch.dtype, device: str, ctx: int,
                 lora_rank: int = 0) -> int:
    """KV slots (tokens) in the memory the KV cache may use, each `KVPool.bytes_per_token` in
    the cache's dtype (an FP8 cache holds twice bfloat16's tokens); weights in `dtype`, and on
    a GPU the LoRA adapters' slots (`lora_rank`: theirs; 0: LoRA is off)."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    per_token = _kv_bytes_per_token(cfg, kv_dtype)
    # Never more than every running request at full context needs.
    ceiling = args.max_running_requests * ctx
    if device.startswith("cuda"):
        # Per GPU: this rank's share of the weights and of the KV heads (every GPU of a
        # tensor-parallel group holds the same share, give or take a row).
        tp, mlp_split = args.tp_size, args.dp_size if args.enable_dp_attention else args.tp_size
        per_token = _kv_bytes_per_token(cfg, kv_dtype, tp)
        free, total = torch.cuda.mem_get_info(torch.device(device))
        weights = weight_bytes(cfg, dtype, tp, mlp_split, device)
        if lora_rank:
            from batonlm.model_runner.lora import slot_bytes

            weights += slot_bytes(cfg, tp_layout(cfg, 0, tp), args.lora_slots, lora_rank, dtype)
        budget = free - weights - int((1 - args.mem_fraction_static) * total)
        if budget <= per_token * ctx:
            raise DeviceConfigError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free, "
                f"weights need about {weights / 2**30:.1f} GiB (raise --mem-fraction-static or use a smaller model)"
            )
        return min(ceiling, budget // per_token)
    return max(min(ceiling, CPU_KV_BUDGET_BYTES // per_token), ctx)


def kv_pool_bytes(spec: DeviceSpec, cfg: ModelConfig) -> int:
    """The KV pool's bytes on one device: every slot (the padding slot too) of its rank's KV
    heads, in the cache's dtype."""
    kv_dtype = kv_cache_dtype(spec.kv_cache_dtype, DTYPES[spec.dtype])
    return (spec.kv_capacity + 1) * _kv_bytes_per_token(cfg, kv_dtype, spec.tp_size)


def _kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype, tp: int = 1) -> int:
    """One token's K and V on one rank of `tp` (KV heads replicated past their count; MLA's
    latent whole on every rank)."""
    return KVPool.bytes_per_token(cfg.num_layers, cfg.kv_heads_per_rank(tp), cfg.kv_head_dim, kv_dtype,
                                  latent=cfg.mla is not None)


# Below this hidden size a forward pass is a stream of tiny ops: more intra-op threads only add
# OpenMP overhead (stories260K, hidden 64: 8,000 vs 9,300 tokens/s at 64 requests). Above it the
# matmuls dominate and scale (a 32M model, hidden 512: 940 vs 560 tokens/s).
MULTITHREAD_MIN_HIDDEN = 256


def cpu_worker_threads(cfg: ModelConfig) -> int:
    """Intra-op threads for the CPU device worker: one for tiny models, so the scheduler keeps a
    core to itself; every core for larger ones, where the matmuls need them more than the
    scheduler (which mostly waits) needs a core of its own."""
    if cfg.hidden_size < MULTITHREAD_MIN_HIDDEN:
        return 1
    # The cores this process may use, not the machine's: under `taskset` or a container's cpuset
    # more threads than cores would take turns on them.
    return max(1, len(cpu_affinity.available_cpus()) or os.cpu_count() or 1)


def default_attention_backend(device: str) -> str:
    """Triton kernels over the pool on a GPU; on the CPU the torch backend (the interpreter is slow)."""
    from batonlm.kernels.sampling import triton_available

    return "triton" if device.startswith("cuda") and triton_available() else "torch"


def default_sampler(device: str) -> str:
    """The Triton kernels on a GPU; on the CPU their torch references (the interpreter is slow)."""
    from batonlm.model_runner.sampler import triton_sampler_available

    return "triton" if device.startswith("cuda") and triton_sampler_available() else "torch"


def _check_transformers_fallback(args: ServerArgs, cfg: ModelConfig) -> None:
    """transformers' layers are whole and run eagerly: one rank per replica, no graphs."""
    if args.tp_size > 1 or args.enable_dp_attention:
        raise DeviceConfigError(
            f"{cfg.architecture} runs on transformers' modeling code, on one device per replica: --tp and "
            "--enable-dp-attention need a native model (docs/models.md); --dp works")
    if args.compile == "on":
        raise DeviceConfigError(f"--compile on: {cfg.architecture} runs on transformers' modeling code, whose "
                                "decode step runs eagerly")
    logger.info("%s runs on transformers' modeling code: the decode step runs eagerly", cfg.architecture)


def decode_step(args: ServerArgs, device: str, attention: str = "triton") -> tuple[int, int]:
    """(compile_max_bs, cuda_graph_max_bs) from `--compile` and the CUDA graph flags. CUDA
    graphs need the Triton attention backend: a graph is captured for the longest context, and
    the torch backend would gather every row's whole context window into it."""
    if device.startswith("cuda"):
        if args.compile == "on":
            raise DeviceConfigError(
                "--compile on applies to the CPU device; on CUDA the decode step is captured as CUDA graphs "
                "(--cuda-graph-max-bs, --disable-cuda-graph)"
            )
        if args.disable_cuda_graph or attention != "triton":
            return 0, 0
        return 0, args.cuda_graph_max_bs or min(args.max_running_requests, CUDA_GRAPH_MAX_BS)
    # auto compiles every native model where a C++ compiler is found: the compiled step is
    # the faster one at every size measured (benchmarks/decode_step.py; docs/benchmarks.md): op
    # dispatch on small models, the weights read at memory bandwidth on larger ones (linear.py).
    # A mixture of experts too: its batch-1 graph gathers a token's K routed experts (2.1x the
    # eager step on a 32-expert Qwen3-MoE), its 2-64 row graph calls the eager step's grouped
    # experts as one op (float; 1.05-1.14x) or runs them all densely (int8, FP8: their GEMMs
    # gain more from the graph) (models.md, benchmarks.md).
    # Not bfloat16 / float16 (auto is float32 on the CPU): fused, the compiled step rounds
    # differently from the eager step and transformers (greedy tokens part after 4-19 on
    # stories260K, where eager bfloat16 keeps transformers' tokens), and is no faster on the CPU
    # (docs/benchmarks.md, "bfloat16 on the CPU").
    if args.compile == "on":
        return min(args.max_running_requests, COMPILE_MAX_BS), 0
    if args.compile == "auto" and args.dtype in ("auto", "float32") and cxx_compiler() is not None:
        return min(args.max_running_requests, COMPILE_MAX_BS), 0
    return 0, 0


def device_spec(args: ServerArgs, cfg: ModelConfig, dp_rank: int = 0, dp_dir: str | None = None) -> DeviceSpec:
    """What data-parallel replica `dp_rank`'s device is built from (on GPUs its own `tp_size` of
    them). With DP attention the replicas' devices meet in `dp_dir` (a directory they share)."""
    device = args.resolved_device
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceConfigError("device 'cuda' was asked for but no CUDA device is available")
    dtype = resolve_dtype(args.dtype, cfg, "cpu" if device == "null" else device)  # null: as a CPU's
    if device == "cpu" and dtype == torch.float16:
        logger.warning("float16 on the CPU is slow and may be inaccurate; float32 is the CPU default")
    if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceConfigError("this GPU does not support bfloat16; use --dtype float16")
    ctx = context_length(args, cfg)
    if device == "null":
        _check_null_device(args)
    attention = args.attention_backend if args.attention_backend != "auto" else default_attention_backend(device)
    sampler = args.sampler if args.sampler != "auto" else default_sampler(device)
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    compile_max_bs, cuda_graph_max_bs = decode_step(args, device, attention) if device != "null" else (0, 0)
    if cfg.impl == "transformers":
        _check_transformers_fallback(args, cfg)
        compile_max_bs = cuda_graph_max_bs = 0
    lora_rank = _check_lora(args, cfg) if args.lora_slots else 0
    if args.tp_size > 1:
        from batonlm.distributed.layout import check_split

        check_split(args.tp_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        if compile_max_bs and args.compile == "on":
            raise DeviceConfigError("--compile on does not apply with --tp > 1: the CPU decode step of a "
                                    "tensor-parallel rank runs eagerly (its all-reduces are not compiled)")
        compile_max_bs = 0
    dp_attention = args.enable_dp_attention
    if dp_attention:
        if dp_dir is None:
            raise DeviceConfigError("DP attention needs the replicas' shared directory (start it with batonlm serve)")
        if args.compile == "on" or cuda_graph_max_bs:
            logger.info("DP attention: the decode step runs eagerly (every rank's MLP gathers all ranks' tokens)")
        compile_max_bs = cuda_graph_max_bs = 0
    local = tuple(args.local_tp_ranks)
    if device == "cuda" and args.dp_size > 1:  # replica k: GPUs k * tp .. (k + 1) * tp - 1
        device = f"cuda:{dp_rank * args.tp_size}"
    # The cores are shared by this node's ranks of every replica.
    threads = args.cpu_worker_threads or max(1, cpu_worker_threads(cfg) // (len(local) * args.dp_size))
    one_worker = device == "cpu" and args.cpu_device_worker == "process" and args.tp_size == args.dp_size == 1
    cpus = cpu_affinity.worker_cpus(threads) if one_worker and args.cpu_affinity == "auto" else ()
    return derive(
        DeviceSpec,
        args,
        model_path=cfg.path,
        model_impl=cfg.impl,
        dtype=dtype_name,
        device=device,
        kv_capacity=_kv_capacity(args, cfg, dtype, device, ctx, lora_rank),
        # Twice the running limit: a finished request's slot is freed one iteration late.
        num_req_slots=2 * args.max_running_requests,
        context_length=ctx,
        attention_backend=attention,
        sampler=sampler,
        cpu_threads=threads,
        worker_cpus=cpus,
        compile_max_bs=compile_max_bs,
        compile_cache_dir=args.compile_cache_dir or str(default_compile_cache_dir()),
        cuda_graph_max_bs=cuda_graph_max_bs,
        draft_model_path=args.speculative_draft_model,
        lora_adapters=args.lora_adapters,
        lora_slots=args.lora_slots,
        lora_rank=lora_rank,
        local_ranks=local,
        dist_init_addr=args.dist_init_addr or (f"127.0.0.1:{free_port()}" if args.tp_size > 1 else ""),
        dp_size=args.dp_size if dp_attention else 1,
        dp_rank=dp_rank if dp_attention else 0,
        dp_init_method=f"file://{dp_dir}/dp-device" if dp_attention else "",
    )


def _check_null_device(args: ServerArgs) -> None:
    """The null device stands in for one device in the scheduler's process: no model to split,
    compile or draft with."""
    for bad, flag in ((args.tp_size > 1, "--tp"), (args.enable_dp_attention, "--enable-dp-attention"),
                      (args.speculative_algorithm == "draft", "--speculative-algorithm draft"),
                      (args.compile == "on", "--compile on")):
        if bad:
            raise DeviceConfigError(f"{flag} needs a model that runs: --device null computes nothing (--dp works)")


def _check_lora(args: ServerArgs, cfg: ModelConfig) -> int:
    """LoRA: a native dense decoder, each --lora-paths adapter a PEFT LoRA that fits it within
    --max-lora-rank. Returns the slots' rank: the largest adapter's, or with room for adapters
    loaded at run time, --max-lora-rank."""
    from batonlm.model_runner.lora import LoRAError, check_adapter, read_adapter

    if cfg.impl != "native" or cfg.mla is not None:
        raise DeviceConfigError("LoRA adapters need a model batonlm runs natively, with no multi-head latent "
                                "attention (not the transformers fallback)")
    ranks = []
    for name, path in args.lora_adapters:
        try:
            adapter = read_adapter(name, path, args.max_lora_rank)
            check_adapter(adapter, cfg)
        except LoRAError as e:
            raise DeviceConfigError(str(e)) from None
        ranks.append(adapter.rank)
    return args.max_lora_rank if args.lora_pool > len(ranks) else max(ranks)


def free_port() -> int:
    """A TCP port free on this host now (the ranks' rendezvous, one node)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_compile_cache_dir() -> Path:
    return cache_root() / "inductor"
