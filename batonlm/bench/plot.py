"""`--plot`: latency distributions and throughput over time in one PNG (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from batonlm.bench.client import RequestResult
from batonlm.bench.metrics import in_flight_over_time, itl_s, output_tokens_over_time

MISSING = "--plot needs matplotlib; install it with `pip install matplotlib` (or the batonlm bench extra)"


def require_matplotlib() -> None:
    """Fail before the run, not after it, when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(MISSING) from None


def _cdf(ax, values_ms: Sequence[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = sorted(values_ms)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
    ax2 = ax.twinx()
    ax2.hist(xs, bins=min(50, max(5, len(xs) // 4)), alpha=0.25, color="tab:orange")
    ax2.set_ylabel("count")


def plot_results(results: Sequence[RequestResult], path: str | Path, title: str = "batonlm bench") -> None:
    """A 2x2 figure: TTFT, ITL and E2E (CDF over a histogram), and output tokens/s and requests
    in flight over time."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _cdf(axes[0][0], [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], "Time to first token")
    _cdf(axes[0][1], [g * 1000 for r in ok for g in itl_s(r)], "Inter-token latency")
    _cdf(axes[1][0], [r.e2e_s * 1000 for r in ok if r.e2e_s is not None], "End-to-end latency")
    ax = axes[1][1]
    series = output_tokens_over_time(results, bin_s=_bin_width(results))
    ax.set_title("Output throughput over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    if series:
        ax.step([t for t, _ in series], [v for _, v in series], where="post", label="output tokens/s")
    flight = in_flight_over_time(results)
    if flight:
        ax2 = ax.twinx()
        ax2.step([t for t, _ in flight], [n for _, n in flight], where="post", color="tab:green", alpha=0.6)
        ax2.set_ylabel("requests in flight", color="tab:green")
    failed = len(results) - len(ok)
    fig.suptitle(f"{title}: {len(ok)} completed, {failed} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bin_width(results: Sequence[RequestResult]) -> float:
    """About 50 bins over the run, at least 10 ms wide."""
    end = max((r.end_s for r in results), default=0.0)
    return max(0.01, end / 50)
