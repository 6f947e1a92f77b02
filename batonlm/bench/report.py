"""The benchmark report: a printed table and the `--output-json` file.

JSON schema (version 1). Times are seconds (`_s`) or milliseconds (`_ms`); a statistic with no
samples is null.

    {
      "schema_version": 1,
      "tool": "batonlm bench",
      "batonlm_version": str,
      "created": str,                 # UTC, ISO 8601
      "args": {...},                  # every command-line argument; `model` as resolved,
                                      # `api_key` "<redacted>" when one was given
      "summary": {
        "completed": int, "failed": int,
        "errors": {message: count},   # failed requests by error message, most common first
        "duration_s": float,          # first request sent -> last request finished
        "total_input_tokens": int,    # prompt tokens (dataset tokenizer) of completed requests
        "total_output_tokens": int,   # usage.completion_tokens, else content chunks counted
        "request_throughput": float,  # completed requests / s
        "input_throughput": float, "output_throughput": float, "total_token_throughput": float,
        "peak_concurrency": int,      # most requests in flight at once
        "ttft_ms": STATS, "tpot_ms": STATS, "itl_ms": STATS, "e2e_ms": STATS
      },                              # STATS = {"mean", "median", "p90", "p99"}
      "bench_serving": {              # the summary under SGLang's bench_serving names:
        "completed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "input_throughput", "output_throughput", "total_throughput",
        "max_concurrency",            # the peak concurrency reached
        "{mean,median,p95,p99}_{ttft,tpot,itl,e2e_latency}_ms"
      },
      "requests": [{                  # in dataset order
        "index": int, "group": int | null,   # group: the shared-prefix group
        "prompt_len": int, "output_len": int,   # as drawn (output_len = requested max tokens)
        "output_tokens": int, "server_prompt_tokens": int | null,   # from the usage chunk
        "success": bool, "error": str | null,
        "scheduled_s": float, "start_s": float,   # planned and actual send, from the run start
        "end_s": float,                           # when the client was done with it (any outcome)
        "ttft_ms": float | null, "tpot_ms": float | null, "e2e_ms": float | null,
        "itl_ms": [float]
      }]
    }
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batonlm.bench.client import RequestResult
from batonlm.bench.metrics import itl_s, tpot_s

SCHEMA_VERSION = 1
TOP_LEVEL_KEYS = ("schema_version", "tool", "batonlm_version", "created", "args", "summary", "bench_serving", "requests")
REQUEST_KEYS = ("index", "group", "prompt_len", "output_len", "output_tokens", "server_prompt_tokens",
                "success", "error", "scheduled_s", "start_s", "end_s", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def request_record(r: RequestResult) -> dict[str, Any]:
    rec = {
        "index": r.index,
        "group": r.group,
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "output_tokens": r.output_tokens,
        "server_prompt_tokens": r.server_prompt_tokens,
        "success": r.success,
        "error": r.error,
        "scheduled_s": r.scheduled_s,
        "start_s": r.start_s,
        "end_s": r.end_s,
        "ttft_ms": _ms(r.ttft_s) if r.success else None,
        "tpot_ms": _ms(tpot_s(r)),
        "e2e_ms": _ms(r.e2e_s),
        "itl_ms": [g * 1000 for g in itl_s(r)] if r.success else [],
    }
    return rec


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # e.g. request_rate inf; JSON has no infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def build_report(args: dict[str, Any], summary: dict[str, Any], results: Sequence[RequestResult]) -> dict[str, Any]:
    from batonlm import __version__

    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "batonlm bench",
        "batonlm_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: _jsonable(v) for k, v in args.items()},
        "summary": summary,
        "bench_serving": bench_serving_metrics(summary, results),
        "requests": [request_record(r) for r in sorted(results, key=lambda r: r.index)],
    }


def bench_serving_metrics(summary: dict[str, Any], results: Sequence[RequestResult]) -> dict[str, Any]:
    """The summary under the names SGLang's (and vLLM's) bench_serving write, so that their
    result files and ours can be read side by side."""
    from batonlm.bench.metrics import percentile

    ok = [r for r in results if r.success]
    series = {
        "ttft": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "tpot": [t * 1000 for r in ok if (t := tpot_s(r)) is not None],
        "itl": [g * 1000 for r in ok for g in itl_s(r)],
        "e2e_latency": [r.e2e_s * 1000 for r in ok if r.e2e_s is not None],
    }
    out: dict[str, Any] = {
        "completed": summary["completed"],
        "duration": summary["duration_s"],
        "total_input_tokens": summary["total_input_tokens"],
        "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"],
        "input_throughput": summary["input_throughput"],
        "output_throughput": summary["output_throughput"],
        "total_throughput": summary["total_token_throughput"],
        "max_concurrency": summary["peak_concurrency"],
    }
    for name, values in series.items():
        out[f"mean_{name}_ms"] = sum(values) / len(values) if values else None
        for label, q in (("median", 50), ("p95", 95), ("p99", 99)):
            out[f"{label}_{name}_ms"] = percentile(values, q) if values else None
    return out


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_table(summary: dict[str, Any], title: str = "batonlm bench", context: Sequence[tuple[str, str]] = ()) -> str:
    """The human-readable result table."""
    width = 62
    rows: list[tuple[str, str]] = [
        *context,
        ("Completed requests", str(summary["completed"])),
        ("Failed requests", str(summary["failed"])),
        ("Duration (s)", _fmt(summary["duration_s"])),
        ("Peak concurrency", str(summary["peak_concurrency"])),
        ("Total input tokens", str(summary["total_input_tokens"])),
        ("Total output tokens", str(summary["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(summary["request_throughput"])),
        ("Input token throughput (tok/s)", _fmt(summary["input_throughput"])),
        ("Output token throughput (tok/s)", _fmt(summary["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(summary["total_token_throughput"])),
    ]
    if "spec_verify_steps" in summary:  # the server speculates
        rows += [("Spec verification steps", str(int(summary["spec_verify_steps"]))),
                 ("Spec accept length (tok/step)", _fmt(summary["spec_accept_length"]))]
    lines = [f" {title} ".center(width, "="), *(f"{k + ':':<34}{v:>28}" for k, v in rows), "-" * width,
             f"{'Latency (ms)':<14}" + "".join(f"{h:>12}" for h in ("mean", "median", "p90", "p99"))]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = summary[key]
        lines.append(f"{name:<14}" + "".join(f"{_fmt(s[k]):>12}" for k in ("mean", "median", "p90", "p99")))
    if summary["errors"]:
        lines.append("-" * width)
        lines.append("Errors (count: message)")
        lines.extend(f"{n:>6}: {msg[:width * 2]}" for msg, n in summary["errors"].items())
    lines.append("=" * width)
    return "\n".join(lines)
