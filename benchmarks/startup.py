"""Cold and warm start-up of `LLM()` on the default model: import, load, compile and first-run every bucket.

Each start is a fresh process with its own persistent compilation cache: the first run fills it (cold),
the next ones read it (warm). With `--baseline PATH` (another checkout, e.g. a `git worktree` of an older
commit) the two alternate, each with its own cache, and the warm medians are compared in the same run.

    python benchmarks/startup.py [--quantization none] [--runs 3] [--baseline /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from jserve import LLM
t1 = time.perf_counter()
LLM(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=512, quantization=sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "total_s": t2 - t0}))
"""


def start(checkout: Path, cache: Path, quantization: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), JAX_COMPILATION_CACHE_DIR=str(cache))
    command = [sys.executable, "-c", PROBE, quantization]
    # Run from the checkout: `python -c` puts the working directory first on sys.path.
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=checkout).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "w8a8"])
    parser.add_argument("--runs", type=int, default=3, help="warm starts per checkout")
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    checkouts = {"this checkout": Path(__file__).resolve().parent.parent}
    if args.baseline:
        checkouts["baseline"] = args.baseline.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        caches = {name: Path(tmp) / str(i) for i, name in enumerate(checkouts)}
        runs: dict[str, list[dict]] = {name: [] for name in checkouts}
        for attempt in range(1 + args.runs):
            for name, checkout in checkouts.items():
                runs[name].append(result := start(checkout, caches[name], args.quantization))
                kind = "cold" if attempt == 0 else "warm"
                print(f"{name:>14} {kind}: {result['total_s']:.2f}s (import {result['import_s']:.2f}s)", flush=True)
    print(f"\n{args.quantization} weights, {args.runs} warm runs each")
    print(f"{'checkout':>14} {'cold s':>8} {'warm s (median)':>16} {'warm s (all)':>24}")
    warm = {}
    for name, results in runs.items():
        totals = [r["total_s"] for r in results]
        warm[name] = statistics.median(totals[1:])
        listed = ", ".join(f"{t:.2f}" for t in totals[1:])
        print(f"{name:>14} {totals[0]:>8.2f} {warm[name]:>16.2f} {listed:>24}")
    if args.baseline:
        print(f"warm start, this checkout / baseline: {warm['this checkout'] / warm['baseline']:.2f}")


if __name__ == "__main__":
    main()
