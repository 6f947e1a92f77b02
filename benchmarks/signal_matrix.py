"""The whole start/stop matrix: {SIGINT, SIGTERM} x {loading, compiling, warm-cache start, idle,
under load, draining} x {1 rank, --tp 2, --dp 2}, each cell a fresh `batonlm serve` stopped by
that signal at that moment (batonlm/bench/signal_probe.py). Prints a table: exit code, seconds
to exit, processes left, how the streams in flight ended, whether a traceback was logged.
--tp 2 has no compiled decode step, so its compile cells are "n/a". Takes ~10 min on 2 cores.

    python benchmarks/signal_matrix.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile

from batonlm.bench.signal_probe import PHASES, SETUPS, as_row, fill_compile_cache, probe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="batonlm-cc-")
    fill_compile_cache(cache)
    rows = []
    print(f"{'setup':8s} {'phase':10s} {'signal':8s} {'exit':>5s} {'s':>6s} {'left':>5s} {'traceback':>9s}  streams")
    for setup in args.setups:
        for phase in PHASES:
            for sig in (signal.SIGINT, signal.SIGTERM):
                if setup == "--tp 2" and phase in ("compiling", "warm"):
                    print(f"{setup:8s} {phase:10s} {sig.name:8s}   n/a")
                    continue
                row = as_row(probe(phase, sig, SETUPS[setup], setup_name=setup, compile_cache=cache))
                rows.append(row)
                print(f"{setup:8s} {phase:10s} {sig.name:8s} {row['exit_code']!s:>5s} {row['exit_s']:6.1f} "
                      f"{row['left']:5d} {row['traceback']!s:>9s}  {','.join(row['streams'])}", flush=True)
    bad = [r for r in rows if r["exit_code"] != 0 or r["exit_s"] > 10 or r["left"] or r["traceback"]]
    print(f"\n{len(rows)} cells, {len(bad)} not clean")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
