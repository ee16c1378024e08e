"""Prefix caching on the generated-shared-prefix workload: the same requests with the cache on and off, in one run.

G groups of P prompts; each group shares a system prompt of S tokens, each prompt adds a question of Q
tokens; O output tokens each (greedy, ignore_eos); prompts are shuffled and arrive at once. Reports the
prompt tokens computed, the share served from the cache, TTFT p50 / p99, output tok/s, and the ratios.

    python benchmarks/prefix_cache.py --num-groups 16 --prompts-per-group 8 --system-prompt-len 256 \\
        --question-len 32 --output-len 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jserve import LLM, SamplingParams


def workload(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    prompts = []
    for _ in range(args.num_groups):
        system = rng.integers(100, 20000, args.system_prompt_len).tolist()
        for _ in range(args.prompts_per_group):
            prompts.append(system + rng.integers(100, 20000, args.question_len).tolist())
    return [prompts[i] for i in rng.permutation(len(prompts))]


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    stats = llm.engine.stats
    computed, hits = stats.prompt_tokens, stats.prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start, arrival = time.perf_counter(), time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - arrival for o in outputs]
    total = sum(map(len, prompts))
    return {
        "prompt tokens": total,
        "computed": stats.prompt_tokens - computed,
        "from cache %": 100 * sum(o.num_cached_tokens for o in outputs) / total,
        "cache hits %": 100 * (stats.prefix_cache_hits - hits) / total,
        "TTFT p50 s": float(np.percentile(ttft, 50)),
        "TTFT p99 s": float(np.percentile(ttft, 99)),
        "out tok/s": len(prompts) * output_len / seconds,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-groups", type=int, default=16)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--schedule-policy", choices=["fcfs", "lpm"], default="fcfs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    prompts = workload(args)
    max_len = args.system_prompt_len + args.question_len + args.output_len + 16
    results = {}
    for caching in (True, False):
        llm = LLM(args.model, dtype="float32", max_model_len=max_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching,
                  schedule_policy=args.schedule_policy)  # fmt: skip
        llm.generate([[101, 102, 103]], SamplingParams(max_tokens=2), use_tqdm=False)  # first-execution costs
        results["cache on" if caching else "cache off"] = run(llm, prompts, args.output_len)
        del llm

    print(
        f"{args.num_groups} groups x {args.prompts_per_group} prompts, system prompt {args.system_prompt_len}, "
        f"question {args.question_len}, output {args.output_len} tokens"
    )
    keys = list(results["cache on"])
    print(f"{'':10}" + "".join(f"{k:>15}" for k in keys))
    for name, r in results.items():
        print(f"{name:10}" + "".join(f"{r[k]:>15.2f}" if isinstance(r[k], float) else f"{r[k]:>15}" for k in keys))
    on, off = results["cache on"], results["cache off"]
    print(
        f"TTFT p50 off / on: {off['TTFT p50 s'] / on['TTFT p50 s']:.2f}x; "
        f"output tok/s on / off: {on['out tok/s'] / off['out tok/s']:.2f}x; "
        f"prompt tokens computed off / on: {off['computed'] / on['computed']:.2f}x"
    )


if __name__ == "__main__":
    main()
