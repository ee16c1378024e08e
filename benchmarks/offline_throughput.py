"""Offline throughput: N requests with random prompts, lengths uniform in ranges, ignore_eos (nano-vllm's shape).

Runs jserve with continuous batching, optionally with static batching (`--static`: batches of
max_num_seqs, each finishing before the next starts), with async scheduling off (`--sync`: the host
prepares each step only after fetching the last one's samples) and transformers' sequential generate
(`--baseline hf`) in the same process, and prints throughput, latency percentiles, host time per step,
device time per step and the device's idle share between steps, and ratios.

    python benchmarks/offline_throughput.py --num-requests 64 --input-len 112 144 --output-len 128 128 \
        --static --baseline hf --baseline-requests 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import numpy as np

from jserve import LLM, SamplingParams
from jserve.attention import ATTENTION_BACKENDS
from jserve.engine.args import DTYPES, KV_CACHE_DTYPES
from jserve.loader.default_model import default_model_path
from jserve.loader.random_weights import MODEL_SHAPES
from jserve.models.quantization import QUANTIZATIONS


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass
class Result:
    name: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft: list[float]
    tpot: list[float]
    steps: int = 0
    host_s: float = 0.0
    device_busy_s: float = 0.0
    device_idle_s: float = 0.0


def make_workload(args, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.input_len[0], args.input_len[1] + 1, args.num_requests)
    # Ids from the lower vocabulary: ordinary tokens, no chat control tokens.
    prompts = [rng.integers(100, min(vocab_size, 20000), n).tolist() for n in lens]
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_requests).tolist()
    return Workload(prompts, outputs)


def run_jserve(llm: LLM, work: Workload, static: bool = False, sync: bool = False, label: str = "") -> Result:
    """All requests arrive at once. Continuous: one generate call. Static: batches of max_num_seqs, each
    running every row to the batch's longest output (as a padded static batch computes) before the next.
    Sync: the same engine with async scheduling switched off for the run."""
    engine = llm.engine
    engine.config = replace(engine.config, async_scheduling=not sync)
    stats = engine.sync_stats()
    before = (stats.steps, stats.host_s, stats.device_busy_s, stats.device_idle_s)
    arrival, start = time.monotonic(), time.perf_counter()
    size = llm.engine.config.max_num_seqs if static else len(work.prompts)
    ttft, tpot = [], []
    for i in range(0, len(work.prompts), size):
        lens = work.output_lens[i : i + size]
        run_lens = [max(lens)] * len(lens) if static else lens
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in run_lens]
        for out, wanted in zip(llm.generate(work.prompts[i : i + size], params, use_tqdm=False), lens, strict=True):
            m = out.metrics
            ttft.append(m.first_token_time - arrival)
            if wanted > 1:  # a static batch answers when its longest row is done
                tpot.append((m.finish_time - m.first_token_time) / (wanted - 1))
    seconds = time.perf_counter() - start
    engine.sync_stats()
    return Result(
        ("jserve static" if static else "jserve sync" if sync else "jserve continuous") + label,
        seconds,
        sum(map(len, work.prompts)),
        sum(work.output_lens),  # useful tokens only: a static batch's padding rows do not count
        ttft,
        tpot,
        stats.steps - before[0],
        stats.host_s - before[1],
        stats.device_busy_s - before[2],
        stats.device_idle_s - before[3],
    )


def run_hf(model_path, work: Workload, count: int) -> Result:
    """transformers float32, one request at a time, in a child process so JAX's threads cannot slow it."""
    payload = json.dumps({"model": str(model_path), "prompts": work.prompts[:count], "lens": work.output_lens[:count]})
    done = subprocess.run([sys.executable, __file__, "--hf-worker"], input=payload, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"transformers baseline failed:\n{done.stderr[-3000:]}")
    return Result(**json.loads(done.stdout.strip().splitlines()[-1]))


def hf_worker() -> None:
    import pathlib

    import torch
    import transformers

    job = json.loads(sys.stdin.read())
    model_path = pathlib.Path(job["model"])
    work = Workload(job["prompts"], job["lens"])
    count = len(work.prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype="float32"
    ).eval()
    ttft, tpot, out_tokens = [], [], 0
    start = time.perf_counter()
    with torch.no_grad():
        for prompt, n in zip(work.prompts[:count], work.output_lens[:count], strict=True):
            t0 = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)
            ttft.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            tpot.append((time.perf_counter() - t1) / n)
            out_tokens += n
    seconds = time.perf_counter() - start - sum(ttft)  # the TTFT probes are not part of the workload
    result = Result("transformers sequential", seconds, sum(map(len, work.prompts)), out_tokens, ttft, tpot)
    print(json.dumps(result.__dict__))


def median_result(runs: list[Result]) -> Result:
    """The run with the median output throughput (for an odd count; the lower middle otherwise)."""
    ranked = sorted(runs, key=lambda r: r.output_tokens / r.seconds)
    return ranked[(len(ranked) - 1) // 2]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(results: list[Result]) -> None:
    print(
        f"{'engine':24} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'host ms/step':>13} {'device ms/step':>15} {'device idle':>12}"
    )
    for r in results:
        n = len(r.ttft)
        steps = r.steps or float("nan")
        idle = r.device_idle_s / (r.device_idle_s + r.device_busy_s) if r.steps else float("nan")
        print(
            f"{r.name:24} {n / r.seconds:7.2f} {r.output_tokens / r.seconds:10.1f} "
            f"{(r.prompt_tokens + r.output_tokens) / r.seconds:12.1f} {pct(r.ttft, 50):9.2f} {pct(r.ttft, 99):9.2f} "
            f"{pct(r.tpot, 50) * 1000:7.1f}ms {pct(r.tpot, 99) * 1000:7.1f}ms {1000 * r.host_s / steps:13.2f} "
            f"{1000 * r.device_busy_s / steps:15.1f} {100 * idle:11.2f}%"
        )
    base = results[0].output_tokens / results[0].seconds
    for r in results[1:]:
        print(f"{results[0].name} / {r.name} output tok/s: {base / (r.output_tokens / r.seconds):.2f}x")


def main() -> None:
    if sys.argv[1:] == ["--hf-worker"]:
        return hf_worker()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--random-weights",
        choices=MODEL_SHAPES,
        default=None,
        metavar="SHAPE",
        help=f"a random-weight model of a named shape instead of --model: {', '.join(MODEL_SHAPES)}",
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 elsewhere")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(112, 144), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--static", action="store_true", help="also run static batching")
    parser.add_argument("--sync", action="store_true", help="also run with async scheduling off")
    parser.add_argument(
        "--compare-attention",
        choices=ATTENTION_BACKENDS,
        default=None,
        metavar="BACKEND",
        help="also run an engine on this attention backend (continuous), alternating",
    )
    parser.add_argument(
        "--compare-xla-int8-dot",
        action="store_true",
        help="with --quantization int8: also run an engine whose projections use XLA's "
        "quantize-and-int8-dot ops instead of the C++ kernel, alternating",
    )
    parser.add_argument("--baseline", choices=["hf"], default=None)
    parser.add_argument("--baseline-requests", type=int, default=4, help="requests the sequential baseline runs")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each jserve mode, alternated; medians")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.compare_xla_int8_dot and args.quantization != "int8":
        parser.error("--compare-xla-int8-dot compares int8 matmuls: add --quantization int8")
    if args.random_weights and args.baseline:
        parser.error("--baseline needs a real checkpoint, not --random-weights")
    model = f"random:{args.random_weights}" if args.random_weights else args.model

    def engine(attention_backend: str, cpu_int8_kernel: bool = True) -> LLM:
        start = time.perf_counter()
        jax.clear_caches()  # each engine traces its step afresh, as the first did: start-up times compare
        llm = LLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                  attention_backend=attention_backend, quantization=args.quantization,
                  cpu_int8_kernel=cpu_int8_kernel, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
        print(
            f"start-up (load + compile {len(llm.engine.runner.executables)} step executables, attention "
            f"{llm.engine.runner.attention.kernel}): {time.perf_counter() - start:.1f}s"
        )
        llm.generate([[100, 101, 102]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)  # first-execution costs
        return llm

    llm = engine(args.attention_backend)
    work = make_workload(args, llm.engine.model.config.vocab_size)
    modes = [(llm, {})] + [(llm, {"sync": True})] * args.sync + [(llm, {"static": True})] * args.static
    if args.compare_attention:
        other = engine(args.compare_attention)
        label = lambda e: f" [{e.engine.runner.attention.kernel}]"  # noqa: E731
        modes = [(e, {**mode, "label": label(e)}) for e, mode in modes] + [(other, {"label": label(other)})]
    if args.compare_xla_int8_dot:
        other = engine(args.attention_backend, cpu_int8_kernel=False)
        modes.append((other, {"label": " [xla int8 dot]"}))
    results = []
    for repeat in range(args.repeats):  # alternate the modes so drifting machine load hits both alike
        results += [run_jserve(e, work, **mode) for e, mode in modes]
        if args.repeats > 1:
            print(
                f"repeat {repeat + 1}/{args.repeats}:",
                *(f"{r.name} {r.output_tokens / r.seconds:.1f} tok/s" for r in results[-len(modes) :]),
            )
    results = [median_result([r for r in results if r.name == name]) for name in dict.fromkeys(r.name for r in results)]
    if args.baseline == "hf":
        model_path = default_model_path() if args.model is None else Path(args.model)
        results.append(run_hf(model_path, work, args.baseline_requests))
    print(
        f"{args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}, "
        f"output {args.output_len[0]}-{args.output_len[1]} tokens, ignore_eos, {llm.engine.model.dtype.name}"
        f"{' int8' if args.quantization == 'int8' else ''}, "
        f"attention {llm.engine.runner.attention.kernel}, {jax.devices()[0].device_kind}"
    )
    report(results)


if __name__ == "__main__":
    main()
