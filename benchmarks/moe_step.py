"""A mixture-of-experts step against the dense model of the same active size, in one run.

Both are random-weight models of SmolLM2-135M's shape (`random:smollm2-135m`, and `random:smollm2-135m-moe`:
every MLP replaced by 8 experts of half the width, each token routed to 2, so a token multiplies as many
weights in both). Each engine times steps of 1, 16, 64 and 512 tokens (`runner.step_seconds`: the fastest of
5 runs of one sequence's chunk); the engines alternate for `--repeats` rounds and the medians are printed
with the ratio. A decode step of 64 sequences costs what a 64-token step costs in its MLPs, where the two
models differ; attention is the same in both.

    python benchmarks/moe_step.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

from jserve import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", default="random:smollm2-135m")
    parser.add_argument("--moe", default="random:smollm2-135m-moe")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()

    engines = {}
    for name, model in (("dense", args.dense), ("moe", args.moe)):
        llm = LLM(model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=64,
                  max_num_batched_tokens=max(args.tokens), max_model_len=1024, enable_prefix_caching=False)  # fmt: skip
        engines[name] = llm.engine.runner
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in engines for n in args.tokens}
    for _ in range(args.repeats):
        for name, runner in engines.items():
            for n in args.tokens:
                times[name, n].append(runner.step_seconds(n))

    model = engines["moe"].model.config
    print(f"{args.moe}: {model.num_experts} experts of {model.moe_intermediate_size}, top {model.num_experts_per_tok}"
          f"; {args.dense}: MLP {engines['dense'].model.config.intermediate_size}; {args.quantization}, "
          f"medians of {args.repeats}")  # fmt: skip
    print(f"{'tokens':>6} {'dense ms':>9} {'moe ms':>9} {'moe / dense':>12}")
    for n in args.tokens:
        dense, moe = (statistics.median(times[name, n]) * 1000 for name in ("dense", "moe"))
        print(f"{n:6d} {dense:9.2f} {moe:9.2f} {moe / dense:11.2f}x")


if __name__ == "__main__":
    main()
