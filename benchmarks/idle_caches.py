"""What a pause costs the host work after it: the same work timed back to back and after the thread has
idled for each --pauses (as the engine thread idles in the fetch while the device runs a step).

On one core (the first), with --running streaming requests decoding: a walk over --buffer-kb of memory, one
random read per cache line (what caches hold for the thread, in ns a line); the engine's own per-request
work after a step (building every request's output, and scheduling the next step; µs a request); and whole
engine steps, each after the pause, in the host ms a step the engine's stats line prints (the device's
threads on the other core). Where something else shares the caches (other tenants of a virtual machine),
data untouched for a few ms is gone, and every pass reads it from memory again. `--spin` idles by busy
waiting instead of sleeping: if the caches still empty, the core's idle state is not what empties them.
The default model steps in ~2 ms (random:quick-1l), so a pause is the only wait that differs between rows.

    python benchmarks/idle_caches.py --running 256 --pauses 0 1 5 20 80
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from host_overhead import make_engine, start_decoding

STEPS = 20  # engine steps timed per pause and repeat (after 3 untimed)


def idle(seconds: float, spin: bool) -> None:
    if not spin:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed(work, pause: float, repeats: int, spin: bool) -> float:
    """Median seconds of `work` run right after a pause (0: after running it once more, so warm)."""
    times = []
    for _ in range(repeats):
        if pause:
            idle(pause, spin)
        else:
            work()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_host_ms(engine, pause: float, repeats: int, spin: bool) -> float:
    """Median over repeats of the engine's host ms a step, each step taken after the pause."""
    stats, results = engine.stats, []
    for _ in range(repeats):
        for _ in range(3):
            engine.step()
            idle(pause, spin)
        steps, host = stats.steps, stats.host_s
        for _ in range(STEPS):
            engine.step()
            idle(pause, spin)
        results.append(1000 * (stats.host_s - host) / (stats.steps - steps))
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:quick-1l", help="as host_overhead.py's --model")
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--pauses", type=float, nargs="+", default=[0, 1, 5, 20, 80], help="ms")
    parser.add_argument("--buffer-kb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--spin", action="store_true", help="busy-wait through each pause instead of sleeping")
    args = parser.parse_args()

    engine = make_engine(args.model, [args.running], max_model_len=1024)
    step_repeats = 3
    start_decoding(engine, np.random.default_rng(0), args.running,
                   max_tokens=len(args.pauses) * step_repeats * (STEPS + 3) + 32)  # fmt: skip
    engine.sync_stats()
    if hasattr(os, "sched_setaffinity"):  # the engine thread on the first core, the device's on the others
        cores = sorted(os.sched_getaffinity(0))
        for thread in map(int, os.listdir("/proc/self/task")):
            os.sched_setaffinity(thread, cores[:1] if thread == os.getpid() or len(cores) == 1 else cores[1:])
    parents, outputs = list(engine.parents.values()), engine.outputs
    buffer = np.ones(args.buffer_kb * 1024 // 4, np.float32)
    lines = np.random.default_rng(0).permutation(len(buffer) // 16) * 16  # one float per 64-byte line

    work = {
        f"walk {args.buffer_kb} KB, ns/line": (lambda: buffer[lines].sum(), len(lines) / 1e9),
        "outputs, µs/request": (lambda: [parent.output(outputs, 0) for parent in parents], args.running / 1e6),
        "schedule, µs/request": (engine.scheduler.schedule, args.running / 1e6),
    }
    how = "busy-waiting" if args.spin else "sleeping"
    print(f"{args.running} running requests, {args.model}, pauses {how}, {args.repeats} repeats, medians\n")
    print("| pause ms | " + " | ".join(work) + " | engine step, host ms |")
    print("| --- |" + " --- |" * (len(work) + 1))
    rows = {pause: [timed(run, pause / 1e3, args.repeats, args.spin) / per for run, per in work.values()]
            for pause in args.pauses}  # fmt: skip
    for pause in args.pauses:  # (steps last: they advance the requests the passes above read)
        rows[pause].append(step_host_ms(engine, pause / 1e3, step_repeats, args.spin))
        print(f"| {pause:g} | " + " | ".join(f"{value:.2f}" for value in rows[pause]) + " |")


if __name__ == "__main__":
    main()
