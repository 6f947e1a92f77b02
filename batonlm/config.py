"""Server arguments: one frozen dataclass, each field declared once with everything about it.

A field's `setting(...)` (batonlm/settings.py) is its flag, its YAML key, its check and its row
in docs/flags.md; `__post_init__` checks every field from those declarations, then the rules
that relate fields to each other (`batonlm/config_relations.py`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batonlm.config_relations import check_relations
from batonlm.model_runner.quantization.config import QUANTIZATION_CHOICES
from batonlm.registries import ATTENTION_BACKENDS, SAMPLERS, TOOL_CALL_PARSERS
from batonlm.sampling_params import MAX_TOP_LOGPROBS
from batonlm.settings import Bound, ConfigError, check_fields, setting

__all__ = ["ConfigError", "ServerArgs", "EMBEDDED_MODEL", "EMBEDDED_MODEL_NAME"]

EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "assets" / "stories260K")
EMBEDDED_MODEL_NAME = "stories260K"

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3", "fp8_e5m2")  # batonlm.model_runner.kv_pool.KV_CACHE_DTYPES
DEVICE_CHOICES = ("auto", "cpu", "cuda", "null")  # null: batonlm.device.null
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# "auto" picks per device; the rest are the registries' names.
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS.names())
SAMPLER_CHOICES = ("auto", *SAMPLERS.names())
TOOL_CALL_PARSER_CHOICES = ("auto", *TOOL_CALL_PARSERS.names())
REASONING_PARSER_CHOICES = ("none", "qwen3", "deepseek-r1")  # batonlm.server.reasoning
POOLING_CHOICES = ("auto", "last", "mean")  # batonlm.server.openai_embeddings
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")  # batonlm.scheduler.schedule_policy
COMPILE_CHOICES = ("auto", "on", "off")
GRAMMAR_WHITESPACE_CHOICES = ("bounded", "compact", "any")  # batonlm.constrained.grammar
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")  # batonlm.scheduler.speculative
LOAD_BALANCE_METHODS = ("prefix", "shortest_queue", "round_robin")  # batonlm.tokenizer_manager.dp_router
# The default of `compile` (the test suite sets it to "off": most tests start engines that do
# not need a compiled step, and `BATONLM_COMPILE=on make test` runs them all compiled).
COMPILE_ENV = "BATONLM_COMPILE"
# Defaults a container sets through the environment (the image listens on 0.0.0.0), and the API
# key, which the environment keeps out of `ps`.
HOST_ENV, PORT_ENV, API_KEY_ENV = "BATONLM_HOST", "BATONLM_PORT", "BATONLM_API_KEY"

# Prompt tokens computed per iteration when --chunked-prefill-size is not given: on a GPU
# SGLang's default; on the CPU a balance between the stalls of running streams and a long
# prompt's TTFT (benchmarks/memory_scheduling.py, chunked-prefill: behind a 4K-token prompt,
# 128 cut the worst stall 19x against whole prompts and the prompt's TTFT by 40%).
DEFAULT_CHUNK = {"cuda": 8192, "cpu": 128, "null": 8192}  # the null device models a GPU
CUDA_GRAPH_MAX_BS = 256

_MODEL, _DEVICE, _SCHED = "model", "device", "memory and scheduling"
_LIMITS, _STRUCT, _SPEC = "request limits", "structured output and tools", "speculative decoding"
_PAR, _HTTP, _OBS = "parallelism", "http", "observability"


@dataclass(frozen=True)
class ServerArgs:
    # ------------------------------------------------------------------ model
    model: str = setting(
        EMBEDDED_MODEL, group=_MODEL, positional=True, shown="the embedded stories260K",
        help="a local Hugging Face model directory or a hub id")
    tokenizer: str | None = setting(None, group=_MODEL, unset="MODEL's", metavar="DIR",
                                    help="the tokenizer's directory or hub id")
    served_model_name: str | None = setting(
        None, group=_MODEL, unset="derived from MODEL", help="the model id clients send")
    context_length: int | None = setting(
        None, group=_MODEL, ge=1, unset="the model's", help="cap the model's context length (tokens)")
    model_impl: str = setting(
        "auto", group=_MODEL, choices=("auto", "native", "transformers"),
        help="native: batonlm's model code (docs/models.md); transformers: transformers' modeling code with "
             "batonlm's paged KV cache (one rank, eager step); auto: native when batonlm has the architecture")
    lora_paths: str | None = setting(
        None, group=_MODEL, metavar="NAME=DIR,...",
        help="LoRA adapters (PEFT directories) served beside the base model, comma-separated name=DIR pairs; a "
             "request selects one by its `model` (docs/lora.md)")
    max_lora_rank: int = setting(64, group=_MODEL, ge=1, help="the largest rank a LoRA adapter may have")
    max_loras_per_batch: int | None = setting(
        None, group=_MODEL, ge=1, unset="--max-loaded-loras",
        help="LoRA adapter slots on the device, so distinct adapters in one batch: the loaded adapters take turns "
             "in them (least recently used out), a request waits while every slot's adapter runs")
    max_loaded_loras: int | None = setting(
        None, group=_MODEL, ge=1, unset="the --lora-paths count",
        help="LoRA adapters loaded at once, held in host memory: those of --lora-paths and those loaded at run "
             "time (POST /v1/load_lora_adapter)")
    quantization: str = setting(
        "auto", group=_MODEL, choices=QUANTIZATION_CHOICES,
        help="the checkpoint's weight quantization (docs/quantization.md): auto reads its quantization_config "
             "(fp8, compressed-tensors, gptq, awq, modelopt, bitsandbytes, fbgemm_fp8; or its tool's file beside "
             "the weights); a method must match it; fp8 on a float checkpoint rounds its projections to FP8 on "
             "load; none refuses a quantized checkpoint")
    pooling: str = setting(
        "auto", group=_MODEL, choices=POOLING_CHOICES,
        help="/v1/embeddings: a prompt's vector is its last hidden states' last token (last) or mean; auto: as "
             "the model's sentence-transformers pooling config says (1_Pooling/config.json), else last")
    # ------------------------------------------------------------------ device and decode step
    device: str = setting(
        "auto", group=_DEVICE, choices=DEVICE_CHOICES,
        help="auto: cuda when there is a GPU, else cpu; null: no model runs (every token a fixed function of the "
             "one before and its position), to measure and test the host side alone (benchmarks/host_overhead.py)")
    null_step_ms: float = setting(0.0, group=_DEVICE, ge=0.0, le=10_000.0, metavar="MS", help="--device null: the "
                                  "modelled time of a device step (3.4: a Llama-3-8B bf16 decode step on an H200)")
    dtype: str = setting("auto", group=_DEVICE, choices=DTYPE_CHOICES,
                         help="auto: float32 on the CPU; on a GPU the checkpoint's half type (bfloat16 for fp32 ones)")
    kv_cache_dtype: str = setting(
        "auto", group=_DEVICE, choices=KV_CACHE_DTYPE_CHOICES,
        help="the KV cache's storage: auto: the model's dtype; fp8_e4m3 / fp8_e5m2: one byte an element (twice "
             "bfloat16's tokens in the same memory), scaled per layer by the checkpoint's k_scale / v_scale, else "
             "1.0 with a warning (docs/quantization.md)")
    attention_backend: str = setting(
        "auto", group=_DEVICE, choices=ATTENTION_BACKEND_CHOICES,
        help="triton: kernels over the KV pool (auto on CUDA); torch: SDPA over the gathered context, decode rows "
             "in float32 reading the pool in place (auto on the CPU)")
    sampler: str = setting("auto", group=_DEVICE, choices=SAMPLER_CHOICES,
                           help="sampling kernels: triton (auto on CUDA) or their torch references (auto on the CPU)")
    cpu_device_worker: str = setting(
        "process", group=_DEVICE, choices=("process", "inline"),
        help="CPU: a worker process beside the scheduler, or inline in it (debugging only: nothing overlaps)")
    cpu_worker_threads: int | None = setting(
        None, group=_DEVICE, ge=1, unset="1 for tiny models, else all cores",
        help="intra-op threads of the CPU device worker")
    cpu_affinity: str = setting(
        "auto", group=_DEVICE, choices=("auto", "off"), env="BATONLM_CPU_AFFINITY",
        help="CPU: auto: where the device worker's threads leave cores free (one replica), the worker keeps the "
             "last cores and the scheduler and the frontend the rest (the OS then never runs them on one core); "
             "off: the OS places them (and for several servers on one machine, whose workers would share the last "
             "cores) (the default is $BATONLM_CPU_AFFINITY when set)")
    compile: str = setting(
        "auto", group=_DEVICE, choices=COMPILE_CHOICES, env=COMPILE_ENV,
        help=f"CPU: torch.compile the decode step (two graphs: one row, and 2 to 64 rows) (auto: on for float32 models where a C++ "
             f"compiler is found; a failed compile falls back to eager; the default is ${COMPILE_ENV} when set)")
    compile_cache_dir: str | None = setting(
        None, group=_DEVICE, metavar="DIR", unset="~/.cache/batonlm/inductor",
        help="where compiled artefacts are kept, so that a restart is fast")
    cuda_graph_max_bs: int | None = setting(
        None, group=_DEVICE, ge=1, unset=f"min(max-running-requests, {CUDA_GRAPH_MAX_BS})",
        help="CUDA: the largest decode batch replayed from a CUDA graph")
    disable_cuda_graph: bool = setting(False, group=_DEVICE, help="CUDA: run the decode step eagerly")
    # ------------------------------------------------------------------ memory and scheduling
    disable_overlap: bool = setting(False, group=_SCHED, help="use the normal (serial) event loop")
    max_running_requests: int = setting(128, group=_SCHED, ge=1, help="requests decoded together")
    max_total_tokens: int | None = setting(
        None, group=_SCHED, ge=1, unset="sized to memory",
        help="the KV cache's capacity in tokens (SGLang's name)")
    max_prefill_tokens: int = setting(16384, group=_SCHED, ge=1, help="prompt tokens admitted into one batch")
    chunked_prefill_size: int | None = setting(
        None, group=_SCHED, ge=-1, unset=f"{DEFAULT_CHUNK['cuda']} on a GPU, {DEFAULT_CHUNK['cpu']} on the CPU",
        help="prompt tokens computed per iteration, beside the running decodes (-1 or 0: prompts computed whole)")
    enable_mixed_batch: bool = setting(
        False, group=_SCHED, help="run whole prompts and decodes in one batch (always so with chunked prefill)")
    disable_radix_cache: bool = setting(
        False, group=_SCHED, help="do not keep computed prefixes for later requests (the prefix cache)")
    schedule_policy: str = setting(
        "fcfs", group=_SCHED, choices=SCHEDULE_POLICIES,
        help="fcfs: arrival order; lpm: longest cached prefix first (with an age bound); priority: the requests' "
             "`priority` (lower values first, vLLM's convention), then arrival, and retraction of the lowest first")
    priority_aging_s: float = setting(
        60.0, group=_SCHED, gt=0, unit="seconds",
        help="--schedule-policy priority: a request waiting this long is admitted next whatever its priority "
             "(none starves)")
    enable_priority_preemption: bool = setting(
        False, group=_SCHED,
        help="--schedule-policy priority: a waiting request that cannot be admitted retracts running requests of "
             "lower priority (they resume later, with the same output)")
    random_seed: int = setting(0, group=_SCHED, help="the seed that seeds requests which give none")
    mem_fraction_static: float = setting(
        0.85, group=_SCHED, gt=0, lt=1, help="GPU: the share of its memory for weights and the KV cache")
    # ------------------------------------------------------------------ request limits
    max_prompts_per_request: int = setting(
        256, group=_LIMITS, ge=1, bounds=Bound(("prompt", "text", "input_ids"), "prompts", "prompts per request"),
        help="prompts in one completions or /generate request")
    max_n: int = setting(16, group=_LIMITS, ge=1, bounds=Bound(("n",), "value", "choices (n)"),
                         help="choices per prompt (n)")
    max_stop_strings: int = setting(16, group=_LIMITS, ge=1, bounds=Bound(("stop", "stop_sequences"), "count", "stop strings"),
                                    help="stop strings per request")
    max_stop_string_length: int = setting(
        1024, group=_LIMITS, ge=1, unit="characters", bounds=Bound(("stop", "stop_sequences"), "each", "characters in a stop string"),
        help="characters in one stop string")
    max_stop_token_ids: int = setting(
        256, group=_LIMITS, ge=1, bounds=Bound(("stop_token_ids",), "count", "stop token ids"),
        help="stop token ids per request")
    max_logit_bias: int = setting(
        1024, group=_LIMITS, ge=1, unit="entries", bounds=Bound(("logit_bias",), "count", "logit_bias entries"),
        help="logit_bias entries per request")
    max_logprobs: int = setting(
        MAX_TOP_LOGPROBS, group=_LIMITS, ge=0, le=MAX_TOP_LOGPROBS,
        bounds=Bound(("top_logprobs", "logprobs", "prompt_logprobs", "top_logprobs_num"), "value", "top logprobs"),
        help="top logprobs per token")
    max_response_bytes: int = setting(
        64 * 1024 * 1024, group=_LIMITS, ge=1024, shown="64 MiB",
        help="a whole (non-streamed) answer's size, estimated from the tokens and logprobs it holds: refused "
             "(400) when it surely exceeds it, ended with a 400 when it grows past it; streams are not bounded")
    max_tools: int = setting(
        128, group=_LIMITS, ge=1, bounds=Bound(("tools",), "count", "tools"),
        help="tools (functions) per chat request: OpenAI's own limit is 128")
    # ------------------------------------------------------------------ structured output and tools
    grammar_whitespace: str = setting(
        "bounded", group=_STRUCT, choices=GRAMMAR_WHITESPACE_CHOICES,
        help="whitespace JSON-schema outputs may have between tokens: bounded (at most 2 in a row), "
             "compact (none) or any (small models may loop on whitespace)")
    tool_call_parser: str = setting(
        "auto", group=_STRUCT, choices=TOOL_CALL_PARSER_CHOICES,
        help="the format tool calls are parsed from with tool_choice auto (auto: from the model; hermes for Qwen "
             "and others)")
    reasoning_parser: str = setting(
        "none", group=_STRUCT, choices=REASONING_PARSER_CHOICES,
        help="split <think>...</think> into message.reasoning_content")
    max_constraint_bytes: int = setting(
        64 * 1024, group=_STRUCT, ge=1, shown="64 KiB",
        help="a JSON schema, regex or grammar larger than this is refused (400): compiles grow with it (a 1 MB "
             "schema took minutes)")
    grammar_compile_timeout: float = setting(
        60.0, group=_STRUCT, gt=0, unit="seconds",
        help="a constrained request whose grammar has not compiled in this time ends with an error")
    # ------------------------------------------------------------------ speculative decoding
    speculative_algorithm: str = setting(
        "none", group=_SPEC, choices=SPECULATIVE_ALGORITHMS,
        help="ngram: drafts from the request's own prompt and output; draft: from a smaller model; either way "
             "verified in one step")
    speculative_draft_model: str | None = setting(
        None, group=_SPEC, metavar="DIR",
        help="draft: the smaller model (same tokenizer, its own KV pool) whose tokens the target verifies")
    speculative_num_draft_tokens: int = setting(
        4, group=_SPEC, ge=1, help="most draft tokens per request and step (adapted per request from its acceptance)")
    speculative_ngram_min: int = setting(2, group=_SPEC, ge=1, help="shortest n-gram a draft is looked up by")
    speculative_ngram_max: int = setting(4, group=_SPEC, ge=1, help="longest n-gram a draft is looked up by")
    speculative_disable_batch_size: int = setting(
        8, group=_SPEC, ge=1, help="no drafts while more requests than this decode")
    speculative_cost_ratio: float | None = setting(
        None, group=_SPEC, ge=0, unset="measured as the loop runs",
        help="what a verification step costs in plain decode steps: drafts go out when they are expected to emit "
             "more tokens (0: always draft)")
    # ------------------------------------------------------------------ parallelism
    tp_size: int = setting(1, group=_PAR, ge=1, flags=("--tp",),
                           help="tensor-parallel ranks (one process each; on GPUs one GPU each)")
    nnodes: int = setting(1, group=_PAR, ge=1, help="nodes the tensor-parallel ranks run on")
    node_rank: int = setting(0, group=_PAR, ge=0, help="this node (0 serves HTTP; the others only run ranks)")
    dist_init_addr: str | None = setting(
        None, group=_PAR, metavar="HOST:PORT", unset="a free local port (one node)",
        help="where the ranks meet: node 0's address and a free port, the same on every node")
    dist_timeout: float = setting(120.0, group=_PAR, gt=0, unit="seconds",
                                  help="a rank silent this long stops the whole group")
    dp_size: int = setting(1, group=_PAR, ge=1, flags=("--dp",),
                           help="data-parallel replicas of the model (each its own scheduler and --tp ranks)")
    load_balance_method: str = setting(
        "prefix", group=_PAR, choices=LOAD_BALANCE_METHODS,
        help="how requests are routed to replicas (prefix: where their prompt's prefix went before)")
    enable_dp_attention: bool = setting(
        False, group=_PAR, help="the replicas run every iteration together, the MLP split over them (an idle "
                                "one runs an idle batch)")
    debug_tp_check_every: int = setting(
        0, group=_PAR, ge=0, metavar="N",
        help="every N launches compare what the ranks computed, stop on a difference (0: off)")
    # ------------------------------------------------------------------ http
    host: str = setting("127.0.0.1", group=_HTTP, env=HOST_ENV, help=f"the address to listen on (${HOST_ENV})")
    port: int = setting(30000, group=_HTTP, ge=1, le=65535, env=PORT_ENV, help=f"the port to listen on (${PORT_ENV})")
    api_key: str | None = setting(
        None, group=_HTTP, env=API_KEY_ENV,
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /version, the API docs and "
             f"/metrics (${API_KEY_ENV}, or --api-key-file, keep it out of `ps`)")
    api_key_file: str | None = setting(None, group=_HTTP, metavar="FILE", help="read the API key from FILE")
    metrics_require_key: bool = setting(False, group=_HTTP, help="/metrics needs the API key too")
    max_request_bytes: int = setting(4 * 1024 * 1024, group=_HTTP, ge=1, shown="4 MiB",
                                     help="a larger request body is answered 413")
    max_connections: int = setting(1024, group=_HTTP, ge=1, help="open connections; 503 beyond")
    client_timeout: float = setting(
        30.0, group=_HTTP, gt=0, unit="seconds",
        help="time a client may take to send a request's head or body, or leave a response unread (408)")
    max_queued_requests: int | None = setting(
        2048, group=_HTTP, ge=1, unset="no limit",
        help="requests waiting for admission beyond --max-running-requests; 429 with Retry-After beyond")
    request_timeout: float | None = setting(
        None, group=_HTTP, gt=0, unit="seconds", unset="no limit", help="time a request may run (408 beyond)")
    stream_interval: int = setting(
        1, group=_HTTP, ge=1, le=1024, unit="tokens",
        help="a request's new tokens go out every this many (its first at once; more when the frontend falls "
             "behind): fewer, larger stream events for less host work per token (SGLang's --stream-interval)")
    max_stream_backlog: int = setting(
        4096, group=_HTTP, ge=1, unit="outputs", help="outputs a stream may fall behind its client before it is aborted")
    responses_store_size: int = setting(
        1024, group=_HTTP, ge=1, unit="responses",
        help="stored responses of /v1/responses (store: true) this server process keeps for previous_response_id "
             "and GET, the least recently used dropped first")
    shutdown_timeout: float = setting(
        30.0, group=_HTTP, gt=0, unit="seconds", help="on SIGTERM, time in-flight requests get to finish")
    watchdog_timeout: float = setting(
        300.0, group=_HTTP, gt=0, unit="seconds",
        help="a scheduler with requests that finishes no iteration for this long (it, its device worker or a "
             "rank is stopped or hung) fails them, /health answers 503 and the server exits 1")
    # ------------------------------------------------------------------ observability
    log_level: str = setting("info", group=_OBS, choices=LOG_LEVELS, help="the log's threshold (every process)")
    debug_future_map: bool = setting(
        False, group=_OBS, help="check every FutureMap read against the token the host saw (slow)")

    def __post_init__(self) -> None:
        check_fields(self)
        check_relations(self)

    @property
    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        """(name, directory) of each --lora-paths adapter, in order (load 1, 2, ...)."""
        if not self.lora_paths:
            return ()
        out = []
        for item in self.lora_paths.split(","):
            name, sep, path = item.strip().partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError("lora_paths", f"each adapter is name=DIR, got {item.strip()!r}")
            out.append((name.strip(), path.strip()))
        names = [n for n, _ in out]
        if len(set(names)) < len(names):
            raise ConfigError("lora_paths", f"two adapters share a name: {sorted(n for n in names if names.count(n) > 1)[0]!r}")
        return tuple(out)

    @property
    def lora_pool(self) -> int:
        """How many LoRA adapters the server holds at once (0: LoRA is off)."""
        return self.max_loaded_loras or len(self.lora_adapters)

    @property
    def lora_slots(self) -> int:
        """The device's LoRA adapter slots (0: LoRA is off)."""
        return min(self.max_loras_per_batch or self.lora_pool, self.lora_pool)

    @property
    def local_tp_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
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
        """The model id clients send: --served-model-name, else a local directory's name (what
        users type; the path is accepted too), else the hub id."""
        if self.served_model_name:
            return self.served_model_name
        if os.path.realpath(self.model) == os.path.realpath(EMBEDDED_MODEL):
            return EMBEDDED_MODEL_NAME
        if os.path.isdir(self.model):
            return os.path.basename(os.path.normpath(self.model))
        return self.model

    def resolved_api_key(self) -> str | None:
        """`api_key`, or the first line of `api_key_file`."""
        if self.api_key_file is None:
            return self.api_key
        try:
            key = Path(self.api_key_file).read_text().strip()
        except OSError as e:
            raise ConfigError("api_key_file", f"cannot read {self.api_key_file!r}: {e.strerror}") from None
        if not key:
            raise ConfigError("api_key_file", f"{self.api_key_file!r} is empty")
        return key

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)
