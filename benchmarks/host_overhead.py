"""Host time per engine step: what the engine thread spends scheduling, preparing, dispatching and processing
outputs, outside waiting for the device, at 1 / 16 / 64 / 256 running sequences.

The model is random weights of a 32-layer, very narrow Llama shape (`--model random:narrow-32l`, defined here):
its layers cost the device little, but sampling over SmolLM2's 49,152 ids does (~75 ms a step at 256 running on
a 2-core CPU), and the engine thread waits that long between its host phases. `--model random:quick-1l` (one
layer, 512 ids) steps in ~2 ms there, as a GPU runs a decode step; idle_caches.py measures what the wait does
to the host time on a shared machine. `--model default` measures the default model's decode.
Each measurement admits N greedy requests (16-token prompts, `ignore_eos`), steps until every one decodes, then
times `--steps` decode steps: the engine's own host ms/step (the figure its stats line prints), wall ms/step,
and, where the engine reports them, the host time by phase. The engine thread gets the first core to itself
and every other thread of the process (XLA's workers, which run the device's step) the others, as a GPU
leaves the host its cores: XLA's CPU client runs a step on as many threads as there are cores, and on 2
cores a step beside the engine thread would take CPU from it, counted as host time (`--no-pin` measures
that instead). Start-up's objects are frozen out of the garbage collector's scans, as `jserve serve` and
`LLM.generate` do (`--no-gc-freeze` leaves them in: a full collection then stalls a step now and then, 170
ms at 256 running; "longest GC ms" is the longest collection in the timed steps). "step call ms" is the
part of launch that is no jserve code: calling the compiled step alone (jit's handling of its input and
output arrays, and XLA's launch), on an idle device.
`--baseline REV` runs the same measurement against the jserve of git revision REV (checked out in a temporary
worktree) in a child process just before, and prints the ratio, so both sides share one machine and one run.
`--pair-continuation K` instead compares two ways of building a step's inputs in one engine: K pairs of
blocks of `--steps` steps, one block with every step built afresh and one continuing the step before where
it can (engine/decode_continuation.py), in alternating order; it prints each side's median and the median of
the pairs' ratios (two sides one process apart drift less than two processes apart).
`--rounds K` alternates the two sides K times (baseline, this, baseline, this, ...) and prints each round's
ratio and the median: on a noisy machine a drift between two back-to-back runs otherwise reads as a ratio.

    python benchmarks/host_overhead.py --model random:narrow-32l default --running 1 16 64 256 --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

# A 32-layer Llama shape with tiny widths and SmolLM2's vocabulary (so its tokenizer decodes every id).
NARROW = dict(family="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=32, num_heads=2,
              num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
              tie_word_embeddings=True)  # fmt: skip
# The same widths in one layer over SmolLM2's first 512 ids: a device step of ~2 ms at 256 rows, so the engine
# thread barely waits between its host phases (the narrow model's sampling over 49,152 logits takes ~75 ms).
QUICK = {**NARROW, "num_layers": 1, "vocab_size": 512}
SHAPES = {"narrow-32l": NARROW, "quick-1l": QUICK}
PROMPT_LEN = 16


def register_shapes() -> None:
    from jserve.config import ModelConfig
    from jserve.loader.random_weights import MODEL_SHAPES

    for name, shape in SHAPES.items():
        MODEL_SHAPES.setdefault(name, ModelConfig(**shape))


# The cores this process may use, read before pin_threads narrows the engine thread's.
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []


def pin_threads() -> bool:
    """The calling (engine) thread alone on the first core, the process's other threads on the rest; False
    where threads cannot be pinned (not Linux, or one core)."""
    if len(CORES) < 2:
        return False
    engine_thread = threading.get_native_id()
    for thread in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(thread, CORES[:1] if thread == engine_thread else CORES[1:])
        except ProcessLookupError:  # ended meanwhile
            pass
    return True


def make_engine(model: str, running: list[int], max_model_len: int):
    """An engine for the largest running count, prefix caching off (every prompt is computed)."""
    register_shapes()
    from jserve import LLM

    largest = max(running)
    llm = LLM(None if model == "default" else model, max_num_seqs=largest, max_model_len=max_model_len,
              max_num_batched_tokens=max(512, largest), enable_prefix_caching=False)  # fmt: skip
    return llm.engine


def start_decoding(engine, rng, n: int, max_tokens: int) -> list[str]:
    """Admit n greedy requests and step until every one decodes; returns their ids."""
    from jserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    top = min(20000, engine.model.config.vocab_size)
    ids = [engine.add_request(rng.integers(100, top, PROMPT_LEN).tolist(), params) for _ in range(n)]
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return ids


def finish(engine, ids: list[str]) -> None:
    """Abort the requests and step until the engine is idle."""
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def measure(model: str, running: list[int], steps: int, repeats: int, pin: bool = True, freeze: bool = True) -> dict:
    """{N: {"host_ms": [...], "wall_ms": [...], "phases_ms": {phase: [...]}}} for one engine. `freeze`: keep the
    garbage collector off the objects start-up built, as `jserve serve` does once its engine is up."""
    engine = make_engine(model, running, max_model_len=1024)
    if freeze:  # (not jserve.heap's helper: a baseline revision may predate it, and this one unfreezes after)
        gc.collect()
        gc.freeze()
    rng = np.random.default_rng(0)
    results = {}
    for n in running:
        entry = {"host_ms": [], "wall_ms": [], "phases_ms": {}, "gc_ms": []}
        for _ in range(repeats):
            if pin and not pin_threads():
                raise SystemExit("cannot pin threads here (needs Linux and 2 cores): run with --no-pin")
            ids = start_decoding(engine, rng, n, max_tokens=steps + 64)
            for _ in range(3):
                engine.step()
            stats = engine.stats
            phases_before = dict(getattr(stats, "phase_s", {}))
            before, start = (stats.steps, stats.host_s), time.perf_counter()
            with collections_timed() as pauses:
                for _ in range(steps):
                    engine.step()
            wall = time.perf_counter() - start
            entry["gc_ms"] += pauses
            done = stats.steps - before[0]
            entry["host_ms"].append(1000 * (stats.host_s - before[1]) / done)
            entry["wall_ms"].append(1000 * wall / steps)
            for phase, seconds in getattr(stats, "phase_s", {}).items():
                ms = 1000 * (seconds - phases_before.get(phase, 0.0)) / done
                entry["phases_ms"].setdefault(phase, []).append(ms)
            finish(engine, ids)
        entry["dispatch_ms"] = dispatch_ms(engine.runner, n)
        results[n] = entry
    if pin:  # child processes (the baseline's) inherit the calling thread's cores
        os.sched_setaffinity(threading.get_native_id(), CORES)
    gc.unfreeze()
    return results


def measure_paired(model: str, running: list[int], steps: int, pairs: int, pin: bool = True) -> None:
    """Host ms/step with every step's inputs built afresh against continued decode steps, paired by block in
    one engine (see --pair-continuation)."""
    engine = make_engine(model, running, max_model_len=2048)
    runner = engine.runner
    launch = runner.launch

    def afresh(sequences):  # no continuation to continue: the step is built from the requests
        runner._continuation = None
        return launch(sequences)

    gc.collect()
    gc.freeze()
    rng = np.random.default_rng(0)
    print(
        f"\n{model}: host ms/step, {pairs} pairs of {steps}-step blocks\n| running | built afresh | continued | "
        "ratio (median of pairs) | continued faster in |\n| --- | --- | --- | --- | --- |"
    )
    for n in running:
        if pin and not pin_threads():
            raise SystemExit("cannot pin threads here (needs Linux and 2 cores): run with --no-pin")
        ids = start_decoding(engine, rng, n, max_tokens=2 * pairs * (steps + 1) + 64)
        host = {"afresh": [], "continued": []}
        for pair in range(pairs):
            for side in ("afresh", "continued") if pair % 2 == 0 else ("continued", "afresh"):
                runner.launch = afresh if side == "afresh" else launch
                engine.step()  # (the block's first step may still continue, or not, the one before)
                before = (engine.stats.steps, engine.stats.host_s)
                for _ in range(steps):
                    engine.step()
                host[side].append(1000 * (engine.stats.host_s - before[1]) / (engine.stats.steps - before[0]))
        runner.launch = launch
        ratios = [a / c for a, c in zip(host["afresh"], host["continued"], strict=True)]
        faster = sum(r > 1 for r in ratios)
        print(
            f"| {n} | {median(host['afresh']):.2f} | {median(host['continued']):.2f} | {median(ratios):.2f}x "
            f"| {faster} of {pairs} |"
        )
        finish(engine, ids)
    if pin:
        os.sched_setaffinity(threading.get_native_id(), CORES)
    gc.unfreeze()


@contextlib.contextmanager
def collections_timed():
    """The milliseconds each garbage collection in the block took (they are part of the host time)."""
    pauses, started = [], [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(1000 * (time.perf_counter() - started[0]))

    gc.callbacks.append(timed)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timed)


def dispatch_ms(runner, num_seqs: int, calls: int = 50) -> list[float]:
    """What calling the compiled step alone costs the host (jit's argument handling and XLA's launch, no
    jserve code), for the bucket a decode of `num_seqs` sequences uses: an all-padding step on an idle device,
    so the call never waits for an earlier one. Call it between measurements, with no request running."""
    bucket = runner.bucket_for(num_seqs)
    step = runner.prepare([], bucket)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        runner._execute(bucket, step)
        times.append(1000 * (time.perf_counter() - start))
        jax.block_until_ready(runner.sampled)
    return times


def run_baseline(rev: str, model: str, running: list[int], steps: int, repeats: int, pin: bool, freeze: bool) -> dict:
    """The same measurement in a child process importing jserve from a worktree of `rev`."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)  # fmt: skip
        try:
            command = [sys.executable, __file__, "--model", model, "--steps", str(steps), "--repeats", str(repeats),
                       *([] if pin else ["--no-pin"]),
                       *([] if freeze else ["--no-gc-freeze"]), "--json", "--running", *map(str, running)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
    return {int(n): entry for n, entry in json.loads(out.strip().splitlines()[-1]).items()}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(model: str, rounds: list[tuple[dict, dict | None]], rev: str | None) -> None:
    """One row per running count: this side's medians (phases from the last round) and, with a baseline,
    the baseline's, each round's host-time ratio and their median."""
    current = rounds[-1][0]
    phases = sorted({p for entry in current.values() for p in entry["phases_ms"]})
    head = ["running", "host ms/step", "wall ms/step", *(f"{p} ms" for p in phases), "step call ms", "longest GC ms"]
    compared = rounds[0][1] is not None
    if compared:
        head += [f"{rev} host ms/step", f"{rev} wall ms/step", "host ratio"]
        if len(rounds) > 1:
            head.append("ratio by round")
    print(f"\n{model}\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))

    def across_rounds(side: int, n: int, key: str) -> float:  # the median of the rounds' medians
        return median([median(r[side][n][key]) for r in rounds])

    for n, entry in current.items():
        cells = [str(n), f"{across_rounds(0, n, 'host_ms'):.2f}", f"{across_rounds(0, n, 'wall_ms'):.2f}"]
        cells += [f"{median(entry['phases_ms'].get(p, [])):.2f}" for p in phases]
        cells.append(f"{median(entry.get('dispatch_ms', [])):.2f}")
        cells.append(f"{max(entry.get('gc_ms', []), default=0.0):.2f}")
        if compared:
            ratios = [median(old[n]["host_ms"]) / median(new[n]["host_ms"]) for new, old in rounds]
            cells += [f"{across_rounds(1, n, 'host_ms'):.2f}", f"{across_rounds(1, n, 'wall_ms'):.2f}"]
            cells.append(f"{median(ratios):.2f}x")
            if len(rounds) > 1:
                cells.append(", ".join(f"{ratio:.2f}" for ratio in ratios))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        nargs="+",
        default=["random:narrow-32l"],
        help="random:narrow-32l or random:quick-1l (defined here), default (SmolLM2-135M), or any model jserve loads",
    )
    parser.add_argument("--running", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per size; medians are printed")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave threads unpinned: the device's work shares the engine thread's core")  # fmt: skip
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave start-up's objects in the garbage collector's full scans")  # fmt: skip
    parser.add_argument("--baseline", metavar="REV", help="also measure the jserve of this git revision")
    parser.add_argument("--rounds", type=int, default=1, help="with --baseline: alternate the two sides this often")
    parser.add_argument("--json", action="store_true", help="print the raw results as one JSON line")
    parser.add_argument("--pair-continuation", type=int, metavar="K",
                        help="compare steps built afresh with continued decode steps, K pairs of blocks")  # fmt: skip
    args = parser.parse_args()
    pin, freeze = not args.no_pin, not args.no_gc_freeze
    for model in args.model:
        if args.pair_continuation:
            measure_paired(model, args.running, args.steps, args.pair_continuation, pin)
            continue
        if args.json:
            print(json.dumps(measure(model, args.running, args.steps, args.repeats, pin, freeze)))
            continue
        rounds = []
        for _ in range(args.rounds if args.baseline else 1):
            baseline = None
            if args.baseline:
                baseline = run_baseline(args.baseline, model, args.running, args.steps, args.repeats, pin, freeze)
            rounds.append((measure(model, args.running, args.steps, args.repeats, pin, freeze), baseline))
        report(model, rounds, args.baseline)


if __name__ == "__main__":
    main()
