"""`batonlm bench`: the command-line front of the load generator.

`add_bench_arguments` fills a parser (the `batonlm bench` subcommand, or the standalone
`python -m batonlm.bench`); `run_bench` runs one benchmark from the parsed arguments and
returns the exit status: 0 when at least one request completed, 1 when none did or the server
could not be asked for its model, 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math

import httpx

from batonlm.bench.client import ENDPOINTS, Target, first_model_id
from batonlm.bench.datasets import DATASETS, BenchRequest, Corpus, DatasetSpec, build_requests, load_tokenizer
from batonlm.bench.metrics import summarize
from batonlm.bench.report import build_report, format_table, write_json
from batonlm.bench.runner import make_client, run_load
from batonlm.bench.server_stats import spec_counters, spec_summary

logger = logging.getLogger(__name__)

DEFAULT_NUM_PROMPTS = 1000


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to `parser`."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server's URL (default: %(default)s)")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="POST /v1/completions or /v1/chat/completions (default: %(default)s)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id from GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--timeout", type=_positive_float, default=3600.0,
                   help="per-request limit in seconds; a request past it fails (default: %(default)s)")

    g = parser.add_argument_group("load")
    g.add_argument("--num-prompts", type=_positive_int, default=None,
                   help=f"requests to send (default: {DEFAULT_NUM_PROMPTS}; shared-prefix: groups x questions)")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="mean requests/s of Poisson arrivals; inf sends all at once (default: inf)")
    g.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="most requests in flight at once (default: unlimited)")
    g.add_argument("--warmup-requests", type=int, default=1,
                   help="requests sent first and not counted (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals (default: %(default)s)")

    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", choices=list(DATASETS), default="random", help="(default: %(default)s)")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer dir measuring prompt lengths (default: the embedded stories260K)")
    g.add_argument("--random-input-len", type=_positive_int, default=256,
                   help="prompt tokens (default: %(default)s)")
    g.add_argument("--random-output-len", type=_positive_int, default=128,
                   help="output tokens requested (default: %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are drawn uniformly in [len * ratio, len] (default: %(default)s, fixed)")
    g.add_argument("--shared-prefix-groups", type=_positive_int, default=8,
                   help="groups sharing a system prompt (default: %(default)s)")
    g.add_argument("--shared-prefix-len", type=_positive_int, default=192,
                   help="tokens of each group's system prompt (default: %(default)s)")
    g.add_argument("--shared-prefix-questions", type=_positive_int, default=16,
                   help="requests per group (default: %(default)s)")
    g.add_argument("--shared-prefix-question-len", type=_positive_int, default=64,
                   help="tokens of each question after the shared prompt (default: %(default)s)")

    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="sharegpt: a ShareGPT-format JSON file (e.g. ShareGPT_V3_unfiltered_cleaned_split.json)")
    g.add_argument("--sharegpt-output-len", type=_positive_int, default=None,
                   help="sharegpt: every output this many tokens (default: each reply's length)")
    g.add_argument("--sharegpt-context-len", type=_positive_int, default=2048,
                   help="sharegpt: skip conversations whose prompt and reply exceed this (default: %(default)s)")
    g = parser.add_argument_group("output")
    g.add_argument("--output-json", default=None, metavar="FILE", help="write the results as JSON")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="draw latency and throughput plots (matplotlib)")
    g.add_argument("--disable-progress-bar", action="store_true", help="no progress bar")


def _dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    shared = args.dataset == "shared-prefix"
    num = args.num_prompts or DEFAULT_NUM_PROMPTS
    if shared and args.num_prompts is not None and args.num_prompts != args.shared_prefix_groups * args.shared_prefix_questions:
        logger.warning("--num-prompts %d ignored: shared-prefix sends groups x questions = %d requests",
                       args.num_prompts, args.shared_prefix_groups * args.shared_prefix_questions)
    return DatasetSpec(
        num_prompts=num,
        input_len=args.shared_prefix_question_len if shared else args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_groups=args.shared_prefix_groups,
        prefix_len=args.shared_prefix_len,
        prefix_questions=args.shared_prefix_questions,
        seed=args.seed,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
        sharegpt_context_len=args.sharegpt_context_len,
    )


async def _run(args: argparse.Namespace, requests: list[BenchRequest]) -> int:
    async with make_client(args.max_concurrency, args.timeout) as client:
        model = args.model
        if model is None:
            try:
                model = await first_model_id(client, args.base_url, args.api_key)
            except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                logger.error("cannot list models at %s/v1/models (pass --model): %s", args.base_url, e or type(e).__name__)
                return 1
            logger.info("model: %s", model)
        target = Target(args.base_url, args.endpoint, model, args.api_key, args.timeout)
        spec_before = await spec_counters(client, args.base_url, args.api_key)
        run = await run_load(client, target, requests, args.request_rate, args.max_concurrency, args.seed,
                             args.warmup_requests, progress=not args.disable_progress_bar)
        spec = spec_summary(spec_before, await spec_counters(client, args.base_url, args.api_key))
    summary = summarize(run.results, run.duration_s, run.peak_concurrency)
    if spec is not None:  # the server speculates: what its drafts gave during the run
        summary.update(spec)
    recorded = {**vars(args), "model": model, "api_key": "<redacted>" if args.api_key else None}
    report = build_report(recorded, summary, run.results)
    print(format_table(summary, context=[("Endpoint", target.url), ("Model", model)]), flush=True)
    if args.output_json:
        write_json(report, args.output_json)
        logger.info("wrote %s", args.output_json)
    if args.plot:
        from batonlm.bench.plot import plot_results

        plot_results(run.results, args.plot, title=f"{model} @ {args.request_rate} req/s")
        logger.info("wrote %s", args.plot)
    return 0 if summary["completed"] else 1


def run_bench(args: argparse.Namespace) -> int:
    """Run one benchmark as `args` describe; returns the exit status."""
    if not logging.getLogger().handlers:  # called from a CLI that set up no logging
        from batonlm.logging_setup import configure_logging

        configure_logging("info", "bench")
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
    if not logger.isEnabledFor(logging.DEBUG):  # httpx's INFO line per request would bury the report
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.warmup_requests < 0:
        logger.error("--warmup-requests must be >= 0, got %d", args.warmup_requests)
        return 2
    if args.plot:
        from batonlm.bench.plot import require_matplotlib

        try:
            require_matplotlib()
        except RuntimeError as e:
            logger.error("%s", e)
            return 2
    try:
        spec = _dataset_spec(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    from batonlm.config import EMBEDDED_MODEL

    try:
        tokenizer = load_tokenizer(args.tokenizer or EMBEDDED_MODEL)
    except (OSError, ValueError) as e:
        logger.error("cannot load the tokenizer at %s: %s", args.tokenizer, e)
        return 2
    try:
        requests = build_requests(args.dataset, Corpus(tokenizer), spec)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    logger.info("%d %s requests, %d prompt tokens in all", len(requests), args.dataset,
                sum(r.prompt_len for r in requests))
    return asyncio.run(_run(args, requests))


def main(argv: list[str] | None = None) -> int:
    """`python -m batonlm.bench`."""
    from batonlm.logging_setup import configure_logging

    parser = argparse.ArgumentParser(prog="python -m batonlm.bench",
                                     description="Load-test an OpenAI-compatible server.")
    add_bench_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    configure_logging(args.log_level, "bench")
    return run_bench(args)
