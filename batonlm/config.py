"""Server arguments: one frozen dataclass, validated at construction, passed down explicitly."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batonlm.registries import ATTENTION_BACKENDS, SAMPLERS, TOOL_CALL_PARSERS
from batonlm.sampling_params import MAX_TOP_LOGPROBS

EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "assets" / "stories260K")
EMBEDDED_MODEL_NAME = "stories260K"

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# "auto" picks per device; the rest are the registries' names.
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS.names())
SAMPLER_CHOICES = ("auto", *SAMPLERS.names())
TOOL_CALL_PARSER_CHOICES = ("auto", *TOOL_CALL_PARSERS.names())
REASONING_PARSER_CHOICES = ("none", "qwen3", "deepseek-r1")  # batonlm.server.reasoning
SCHEDULE_POLICIES = ("fcfs", "lpm")  # batonlm.scheduler.schedule_policy
COMPILE_CHOICES = ("auto", "on", "off")
GRAMMAR_WHITESPACE_CHOICES = ("bounded", "compact", "any")  # batonlm.constrained.grammar
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")  # batonlm.scheduler.speculative
LOAD_BALANCE_METHODS = ("prefix", "shortest_queue", "round_robin")  # batonlm.tokenizer_manager.dp_router
# The default of `compile` (the test suite sets it to "off": most tests start engines that do
# not need a compiled step, and `BATONLM_COMPILE=on make test` runs them all compiled).
COMPILE_ENV = "BATONLM_COMPILE"


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
    # Required as "Authorization: Bearer KEY" on /v1 and /generate. The CLI also reads it from
    # $BATONLM_API_KEY or `api_key_file`, so that it need not show in `ps`.
    api_key: str | None = None
    api_key_file: str | None = None
    # Limits on one request (a 413 or a 400 naming the field beyond them).
    max_request_bytes: int = 4 * 1024 * 1024
    max_prompts_per_request: int = 256
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_length: int = 1024
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024
    max_logprobs: int = MAX_TOP_LOGPROBS
    # Limits on the server: open connections (503 beyond), seconds a client may take to send a
    # request's head or body or leave a response unread (then 408 / closed), requests waiting
    # for admission (429 beyond), seconds a request may run (None: unbounded), outputs a stream
    # may fall behind its client (then aborted).
    max_connections: int = 1024
    client_timeout: float = 30.0
    max_queued_requests: int | None = 2048
    request_timeout: float | None = None
    max_stream_backlog: int = 4096
    # On SIGTERM: seconds in-flight requests get to finish before they are aborted with an error.
    shutdown_timeout: float = 30.0
    # Scheduling
    disable_overlap: bool = False
    max_running_requests: int = 128
    # The KV capacity in tokens (SGLang's flag name); None: sized to the device's memory.
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 16384
    # Prompt tokens computed per iteration, in the same batch as the running decodes; None: the
    # device's default; -1 (or 0): prompts are computed whole.
    chunked_prefill_size: int | None = None
    enable_mixed_batch: bool = False
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
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
    # The decode step. CPU: compiled with torch.compile for batch-size buckets ("auto": on for
    # small models where a C++ compiler is there, see device/spec.compile_pays; a failed
    # compile falls back to eager), its artefacts cached in
    # `compile_cache_dir` (None: ~/.cache/batonlm/inductor). CUDA: captured as CUDA graphs for
    # decode batches up to `cuda_graph_max_bs` (None: min(max_running_requests, 256)).
    compile: str = field(default_factory=lambda: os.environ.get(COMPILE_ENV) or "auto")
    compile_cache_dir: str | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    # JSON schemas: whitespace between tokens at most 2 characters in a row (bounded), none
    # (compact) or any (small models may loop on whitespace).
    grammar_whitespace: str = "bounded"
    # The format tool calls are parsed from with tool_choice auto (auto: from the model).
    tool_call_parser: str = "auto"
    # Models that think in <think>...</think>: none, qwen3, deepseek-r1 (batonlm.server.reasoning).
    reasoning_parser: str = "none"
    # Speculative decoding (batonlm/scheduler/speculative.py): "ngram" drafts up to
    # `speculative_num_draft_tokens` tokens from a request's own prompt and output (n-grams of
    # speculative_ngram_min..max tokens), off while more than `speculative_disable_batch_size`
    # requests decode.
    speculative_algorithm: str = "none"
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_disable_batch_size: int = 8
    # "draft": the drafts come from this smaller model sharing the tokenizer (its own KV pool).
    speculative_draft_model: str | None = None
    # What a verification step costs in plain decode steps, the drafting gate's threshold
    # (None: measured as the loop runs; 0: draft whenever there is a draft).
    speculative_cost_ratio: float | None = None
    # Tensor parallelism (docs/distributed.md): the model split over `tp_size` ranks (processes;
    # on a GPU node one per GPU), over `nnodes` nodes. Node 0 serves HTTP and runs the scheduler
    # and ranks 0..tp/nnodes-1; node k runs the next tp/nnodes ranks only. The ranks rendezvous
    # at `dist_init_addr` (host:port on node 0; a free local port when one node). A rank silent
    # for `dist_timeout` seconds ends the whole group, non-zero.
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 120.0
    # Data parallelism: `dp_size` replicas of the model, each its own scheduler (and `tp_size`
    # ranks), requests routed by `load_balance_method` (batonlm/tokenizer_manager/dp_router.py).
    # With `enable_dp_attention` the replicas run every iteration together (docs/distributed.md).
    dp_size: int = 1
    load_balance_method: str = "prefix"
    enable_dp_attention: bool = False
    # Every this many launches the ranks all-gather a hash of what they computed (batch, lengths,
    # sampled ids) and stop with an error on any difference (0: off).
    debug_tp_check_every: int = 0
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
        _choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _choice("compile", self.compile, COMPILE_CHOICES)
        _choice("grammar_whitespace", self.grammar_whitespace, GRAMMAR_WHITESPACE_CHOICES)
        _choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSER_CHOICES)
        _choice("reasoning_parser", self.reasoning_parser, REASONING_PARSER_CHOICES)
        if self.chunked_prefill_size is not None and not (
            isinstance(self.chunked_prefill_size, int) and self.chunked_prefill_size >= -1
        ):
            raise ConfigError("chunked_prefill_size", f"must be a token count, or -1 (off), got {self.chunked_prefill_size!r}")
        _choice("speculative_algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS)
        for name in ("speculative_num_draft_tokens", "speculative_ngram_min", "speculative_disable_batch_size"):
            _positive(name, getattr(self, name))
        if self.speculative_cost_ratio is not None and not (
            isinstance(self.speculative_cost_ratio, (int, float)) and 0 <= self.speculative_cost_ratio < float("inf")
        ):
            raise ConfigError("speculative_cost_ratio", f"must be a number >= 0, got {self.speculative_cost_ratio!r}")
        if (self.speculative_algorithm == "draft") != (self.speculative_draft_model is not None):
            raise ConfigError("speculative_draft_model", "give a draft model with --speculative-algorithm draft, "
                              "and only then")
        if not (isinstance(self.speculative_ngram_max, int) and self.speculative_ngram_max >= self.speculative_ngram_min):
            raise ConfigError("speculative_ngram_max", f"must be at least speculative_ngram_min "
                              f"({self.speculative_ngram_min}), got {self.speculative_ngram_max!r}")
        _positive("max_running_requests", self.max_running_requests)
        _positive("max_prefill_tokens", self.max_prefill_tokens)
        for name in (
            "max_request_bytes", "max_prompts_per_request", "max_n", "max_stop_strings", "max_stop_string_length",
            "max_stop_token_ids", "max_logit_bias", "max_connections", "max_stream_backlog",
        ):
            _positive(name, getattr(self, name))
        if not (isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError("max_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.max_logprobs!r}")
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("api_key_file", "give the API key or a file holding it, not both")
        if self.max_queued_requests is not None:
            _positive("max_queued_requests", self.max_queued_requests)
        for name in ("client_timeout", "shutdown_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")
        if self.max_total_tokens is not None:
            _positive("max_total_tokens", self.max_total_tokens)
        if self.context_length is not None:
            _positive("context_length", self.context_length)
        if self.cpu_worker_threads is not None:
            _positive("cpu_worker_threads", self.cpu_worker_threads)
        if self.cuda_graph_max_bs is not None:
            _positive("cuda_graph_max_bs", self.cuda_graph_max_bs)
        self._check_distributed()
        if not 0 < self.port < 65536:
            raise ConfigError("port", f"must be in 1..65535, got {self.port}")
        if not 0 < self.mem_fraction_static < 1:
            raise ConfigError("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        if self.extra:
            raise ConfigError(next(iter(self.extra)), "unknown server argument")

    def _check_distributed(self) -> None:
        _positive("tp_size", self.tp_size)
        _positive("dp_size", self.dp_size)
        _choice("load_balance_method", self.load_balance_method, LOAD_BALANCE_METHODS)
        if self.dp_size > 1 and self.nnodes > 1:
            raise ConfigError("dp_size", "data parallelism runs on one node (give nnodes 1, or dp_size 1)")
        if self.dp_size > 1 and self.dist_init_addr is not None:
            raise ConfigError("dist_init_addr", "is for several nodes; with --dp each replica's ranks meet at a "
                              "free local port of their own")
        if self.enable_dp_attention and self.dp_size < 2:
            raise ConfigError("enable_dp_attention", "needs at least two data-parallel replicas (--dp 2 or more)")
        if self.enable_dp_attention and self.tp_size > 1:
            raise ConfigError("enable_dp_attention", "runs one rank per replica: give --tp 1 (the MLP is split "
                              "over the replicas instead)")
        if self.enable_dp_attention and self.speculative_algorithm != "none":
            raise ConfigError("enable_dp_attention", "does not combine with speculative decoding")
        _positive("nnodes", self.nnodes)
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise ConfigError("node_rank", f"must be in 0..{self.nnodes - 1} (nnodes {self.nnodes}), got {self.node_rank!r}")
        if self.tp_size % self.nnodes:
            raise ConfigError("nnodes", f"the tensor parallel size ({self.tp_size}) must be a multiple of the node "
                              f"count ({self.nnodes}): every node runs the same number of ranks")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ConfigError("dist_init_addr", "give node 0's host:port (every node the same) when nnodes > 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError("dist_init_addr", f"must be host:port, got {self.dist_init_addr!r}")
        if not (isinstance(self.dist_timeout, (int, float)) and 0 < self.dist_timeout < float("inf")):
            raise ConfigError("dist_timeout", f"must be a positive number of seconds, got {self.dist_timeout!r}")
        if not (isinstance(self.debug_tp_check_every, int) and self.debug_tp_check_every >= 0):
            raise ConfigError("debug_tp_check_every", f"must be a launch count >= 0, got {self.debug_tp_check_every!r}")

    @property
    def local_tp_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

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


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}, got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")
