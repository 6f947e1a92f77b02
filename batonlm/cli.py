"""The `batonlm` command: `batonlm serve [MODEL] ...`, `batonlm bench ...`."""

from __future__ import annotations

import argparse
import os
import sys

from batonlm.config import (
    ATTENTION_BACKEND_CHOICES,
    COMPILE_CHOICES,
    COMPILE_ENV,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    EMBEDDED_MODEL,
    GRAMMAR_WHITESPACE_CHOICES,
    LOAD_BALANCE_METHODS,
    LOG_LEVELS,
    REASONING_PARSER_CHOICES,
    SAMPLER_CHOICES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSER_CHOICES,
    ConfigError,
    ServerArgs,
)

# Defaults a container sets through the environment (the image listens on 0.0.0.0), and the
# API key, which the environment keeps out of `ps`.
HOST_ENV, PORT_ENV, API_KEY_ENV = "BATONLM_HOST", "BATONLM_PORT", "BATONLM_API_KEY"


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    bool_flag = argparse.BooleanOptionalAction
    p.add_argument("model", nargs="?", default=None,
                   help="a local Hugging Face model directory or a hub id (default: the embedded stories260K)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML preset of server arguments (see configs/); flags given here override it")
    p.add_argument("--host", default=os.environ.get(HOST_ENV, d.host), help=f"default: ${HOST_ENV} or {d.host}")
    p.add_argument("--port", type=int, default=int(os.environ.get(PORT_ENV, d.port)))
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: derived from MODEL)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: MODEL)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 and /generate (default: ${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE")
    p.add_argument("--disable-overlap", action=bool_flag, default=False, help="use the normal (serial) event loop")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens (default: sized to memory)")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--context-length", type=int, default=None, help="cap the model's context length")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prompt tokens computed per iteration, beside the running decodes "
                        "(default: 8192 on a GPU, 256 on the CPU; -1: compute prompts whole)")
    p.add_argument("--enable-mixed-batch", action=bool_flag, default=False,
                   help="run whole prompts and decodes in one batch (always so with chunked prefill)")
    p.add_argument("--disable-radix-cache", action=bool_flag, default=False,
                   help="do not keep computed prefixes for later requests")
    p.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default=d.schedule_policy,
                   help="fcfs: arrival order; lpm: longest cached prefix first (with an age bound)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype)
    p.add_argument("--device", choices=DEVICE_CHOICES, default=d.device)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKEND_CHOICES, default=d.attention_backend,
                   help="triton: kernels over the KV pool (auto on CUDA); torch: gather + SDPA (auto on the CPU)")
    p.add_argument("--sampler", choices=SAMPLER_CHOICES, default=d.sampler,
                   help="sampling kernels: triton (auto on CUDA) or their torch references (auto on the CPU)")
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    limits = p.add_argument_group("limits", "what one request, and the server, accept (see docs/limits.md)")
    limits.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="413 above this body size")
    limits.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request)
    limits.add_argument("--max-n", type=int, default=d.max_n, help="choices per prompt")
    limits.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
    limits.add_argument("--max-stop-string-length", type=int, default=d.max_stop_string_length)
    limits.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids)
    limits.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="logit_bias entries")
    limits.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="top logprobs per token (<= 20)")
    limits.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections; 503 beyond")
    limits.add_argument("--client-timeout", type=float, default=d.client_timeout,
                        help="seconds a client may take to send a request's head or body, or leave a response unread")
    limits.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                        help="requests waiting for admission; 429 with Retry-After beyond")
    limits.add_argument("--request-timeout", type=float, default=None, help="seconds a request may run (default: no limit)")
    limits.add_argument("--max-stream-backlog", type=int, default=d.max_stream_backlog,
                        help="outputs a stream may fall behind its client before it is aborted")
    limits.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                        help="on SIGTERM, seconds in-flight requests get to finish")
    p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    p.add_argument("--cpu-worker-threads", type=int, default=None,
                   help="intra-op threads of the CPU device worker (default: 1 for tiny models, else all cores)")
    step = p.add_argument_group("decode step", "compiled on the CPU, CUDA graphs on a GPU (see docs/benchmarks.md)")
    step.add_argument("--compile", choices=COMPILE_CHOICES, default=d.compile,
                      help="CPU: torch.compile the decode step (auto: on for small models where a C++ compiler is found; "
                           f"default: ${COMPILE_ENV} or auto)")
    step.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                      help="where compiled artefacts are kept, so a restart is fast (default: ~/.cache/batonlm/inductor)")
    step.add_argument("--cuda-graph-max-bs", type=int, default=None,
                      help="CUDA: largest decode batch replayed from a CUDA graph (default: min(max-running-requests, 256))")
    step.add_argument("--disable-cuda-graph", action=bool_flag, default=False, help="CUDA: run the decode step eagerly")
    p.add_argument("--grammar-whitespace", choices=GRAMMAR_WHITESPACE_CHOICES, default=d.grammar_whitespace,
                   help="whitespace JSON-schema outputs may have between tokens: bounded (at most 2 in a row), "
                        "compact (none) or any")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_CHOICES, default=d.tool_call_parser,
                   help="the format tool calls are parsed from (auto: from the model; hermes for Qwen and others)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_CHOICES, default=d.reasoning_parser,
                   help="split <think>...</think> into message.reasoning_content (qwen3, deepseek-r1)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS, default=d.speculative_algorithm,
                      help="ngram: draft tokens from the request's own prompt and output; draft: from a smaller "
                           "model; either way verified in one step")
    spec.add_argument("--speculative-draft-model", default=None, metavar="DIR",
                      help="draft: the smaller model (same tokenizer) whose tokens the target verifies")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
                      help="most draft tokens per request and step (adapted per request from its acceptance)")
    spec.add_argument("--speculative-ngram-min", type=int, default=d.speculative_ngram_min,
                      help="shortest n-gram a draft is looked up by")
    spec.add_argument("--speculative-ngram-max", type=int, default=d.speculative_ngram_max,
                      help="longest n-gram a draft is looked up by")
    spec.add_argument("--speculative-cost-ratio", type=float, default=d.speculative_cost_ratio,
                      help="what a verification step costs in plain decode steps: drafts go out when they are "
                           "expected to emit more tokens (default: measured; 0: always draft)")
    spec.add_argument("--speculative-disable-batch-size", type=int, default=d.speculative_disable_batch_size,
                      help="no drafts while more requests than this decode")
    dist = p.add_argument_group("tensor parallelism", "the model split over processes and nodes (docs/distributed.md)")
    dist.add_argument("--tp", "--tp-size", dest="tp_size", type=int, default=d.tp_size,
                      help="tensor-parallel ranks (one process each; on GPUs one GPU each)")
    dist.add_argument("--nnodes", type=int, default=d.nnodes, help="nodes the ranks run on")
    dist.add_argument("--node-rank", type=int, default=d.node_rank,
                      help="this node (0 serves HTTP; the others only run ranks)")
    dist.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                      help="where the ranks meet: node 0's address and a free port (default, one node: a free local port)")
    dist.add_argument("--dist-timeout", type=float, default=d.dist_timeout,
                      help="seconds a rank may be silent before the whole group stops")
    dist.add_argument("--dp", "--dp-size", dest="dp_size", type=int, default=d.dp_size,
                      help="data-parallel replicas of the model (each its own scheduler and --tp ranks)")
    dist.add_argument("--load-balance-method", choices=LOAD_BALANCE_METHODS, default=d.load_balance_method,
                      help="how requests are routed to replicas (prefix: where their prompt's prefix went before)")
    dist.add_argument("--enable-dp-attention", action=bool_flag, default=False,
                      help="the replicas run every iteration together (an idle one runs an idle batch)")
    dist.add_argument("--debug-tp-check-every", type=int, default=d.debug_tp_check_every, metavar="N",
                      help="every N launches compare what the ranks computed; stop on a difference (0: off)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level)


def serve_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    fields = {k: v for k, v in vars(ns).items() if k not in ("command", "func", "config")}
    fields["model"] = fields["model"] or EMBEDDED_MODEL
    return ServerArgs.from_kwargs(**fields)


def parse_serve_args(argv: list[str]) -> ServerArgs:
    """`serve` arguments: defaults, then the --config file, then the flags given."""
    parser = argparse.ArgumentParser(prog="batonlm serve")
    _add_serve_arguments(parser)
    ns = parser.parse_args(argv)
    if ns.config:
        from batonlm.config_file import load_config_file

        parser.set_defaults(**load_config_file(ns.config))
        ns = parser.parse_args(argv)
    return serve_args_from_namespace(ns)


def _serve(ns: argparse.Namespace) -> int:
    from batonlm.server.serve import serve

    try:
        args = parse_serve_args(ns.argv)
    except ConfigError as e:
        print(f"batonlm serve: error: {e}", file=sys.stderr)
        return 2
    return serve(args)


def _bench(ns: argparse.Namespace) -> int:
    from batonlm.bench.cli import run_bench

    return run_bench(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batonlm", description="batonlm: an LLM serving engine with an overlap loop")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    try:
        from batonlm.bench.cli import add_bench_arguments
    except ImportError:
        add_bench_arguments = None
    if add_bench_arguments is not None:
        bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
        add_bench_arguments(bench)
        bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    ns.argv = argv[1:]  # what follows the subcommand, re-parsed with any --config preset
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
