"""What a pause costs the host work after it: the same work timed back to back and after the thread has
slept for each --pauses (as the engine thread sleeps in the fetch while the device runs a step).

Two kinds of work, on one core (the first): a walk over --buffer-kb of memory, one random read per cache
line (what caches hold for the thread, in ns a line), and the engine's own per-request work after a step
with --running streaming requests decoding (building every request's output, and scheduling the next
step; µs a request). Where something else shares the caches (other tenants of a virtual machine), data
untouched for a few ms is gone, and the per-request passes read it from memory again: compare the host
ms/step of benchmarks/host_overhead.py with these.

    python benchmarks/idle_caches.py --running 256 --pauses 0 1 5 20 80
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from host_overhead import make_engine, start_decoding


def timed(work, pause: float, repeats: int) -> float:
    """Median seconds of `work` run right after a pause (0: after running it once more, so warm)."""
    times = []
    for _ in range(repeats):
        if pause:
            time.sleep(pause)
        else:
            work()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--pauses", type=float, nargs="+", default=[0, 1, 5, 20, 80], help="ms")
    parser.add_argument("--buffer-kb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    engine = make_engine("random:narrow-32l", [args.running], max_model_len=1024)
    start_decoding(engine, np.random.default_rng(0), args.running, max_tokens=900)
    engine.sync_stats()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    parents, outputs = list(engine.parents.values()), engine.outputs
    buffer = np.ones(args.buffer_kb * 1024 // 4, np.float32)
    lines = np.random.default_rng(0).permutation(len(buffer) // 16) * 16  # one float per 64-byte line

    work = {
        f"walk {args.buffer_kb} KB, ns/line": (lambda: buffer[lines].sum(), len(lines) / 1e9),
        "outputs, µs/request": (lambda: [parent.output(outputs) for parent in parents], args.running / 1e6),
        "schedule, µs/request": (engine.scheduler.schedule, args.running / 1e6),
    }
    print(f"{args.running} running requests, random:narrow-32l, {args.repeats} repeats, medians\n")
    print("| pause ms | " + " | ".join(work) + " |")
    print("| --- |" + " --- |" * len(work))
    for pause in args.pauses:
        row = [timed(run, pause / 1e3, args.repeats) / per for run, per in work.values()]
        print(f"| {pause:g} | " + " | ".join(f"{value:.2f}" for value in row) + " |")


if __name__ == "__main__":
    main()
