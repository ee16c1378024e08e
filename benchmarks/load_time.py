"""Load time and peak RSS of the default model from its GGUF and from its `jserve convert` Orbax folder.

Each load runs in a fresh process (nothing compiled or imported beforehand), alternating between the
two sources, and the medians are compared in the same run.

    python benchmarks/load_time.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from jserve.loader import load_model
t1 = time.perf_counter()
model = load_model(sys.argv[1], dtype="float32")
import jax; jax.block_until_ready(model.params)
t2 = time.perf_counter()
# VmHWM, not ru_maxrss: the latter survives exec and would report the parent's peak.
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
peak_mb = int(hwm.split()[1]) / 1024
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "peak_rss_mb": peak_mb}))
"""


def measure(source: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, source], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from jserve.loader import load_model
    from jserve.loader.default_model import default_model_path

    gguf = str(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        orbax = str(Path(tmp) / "smollm2-orbax")
        load_model(gguf, dtype="float32").save_orbax(orbax)
        runs: dict[str, list[dict]] = {"gguf": [], "orbax": []}
        for _ in range(args.repeats):
            for name, source in (("gguf", gguf), ("orbax", orbax)):
                runs[name].append(measure(source))
    print(f"SmolLM2-135M-Instruct, float32, fresh process per load, {args.repeats} alternating runs (medians):")
    print(f"{'source':8} {'load s':>8} {'import s':>9} {'peak RSS MB':>12}")
    medians = {}
    for name, results in runs.items():
        medians[name] = {k: statistics.median(r[k] for r in results) for k in results[0]}
        m = medians[name]
        print(f"{name:8} {m['load_s']:8.2f} {m['import_s']:9.2f} {m['peak_rss_mb']:12.0f}")
    print(f"orbax / gguf load time: {medians['orbax']['load_s'] / medians['gguf']['load_s']:.2f}")


if __name__ == "__main__":
    main()
