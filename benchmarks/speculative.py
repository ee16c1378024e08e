"""Speculative decoding: the same requests with and without speculation, in one run, on the default model.

Two workloads of 8 chat requests each: (a) copy-heavy: edits whose answers quote the prompt (code with a
requested change, text to correct, data to reformat); (b) open-ended chat. Greedy, max_tokens 256, so both
engines emit the same tokens (checked). At concurrency 1 each request runs alone; at C, requests run C at a
time. Each repeat runs both engines in alternating order. Prints output tok/s and TPOT medians, the ratio,
and the speculating engine's mean acceptance length (tokens a verification yields, its bonus token
included) and draft acceptance rate.

    python benchmarks/speculative.py --repeats 3
    python benchmarks/speculative.py --repeats 3 --quantization int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jserve import LLM, SamplingParams

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
"""
CLASS = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0
"""
TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked loudly at the fox. "
    "Then the fox ran away into the forest, where it met a friendly rabbit who offered it some carrots."
)
COPY_HEAVY = [
    f"Rename the variable `subtotal` to `net_total` in this Python function and return the whole function:\n\n{CODE}",
    f"Add a docstring to each method of this class and return the full class:\n\n{CLASS}",
    "Fix the spelling in this text and return it unchanged otherwise:\n\n"
    + TEXT.replace("jumps", "jumsp").replace("barked", "barkd").replace("forest", "forrest"),
    f"Add type hints to this class and return the complete code:\n\n{CLASS}",
    f"Repeat the following text exactly, then add one sentence at the end:\n\n{TEXT}",
    "Convert this list to a JSON array of objects with keys name and age:\nAlice, 30\nBob, 25\nCarol, 41\n"
    "Dave, 19\nEve, 33",
    f"Add a comment above each line of this function explaining it:\n\n{CODE}",
    f"Rewrite this class so that `pop` returns None when the stack is empty:\n\n{CLASS}",
]
OPEN_CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are some good tips for staying productive when working from home?",
    "Explain how photosynthesis works to a ten-year-old.",
    "Give me three ideas for a birthday party for a seven-year-old.",
    "What is the difference between a virus and a bacterium?",
    "Write a poem about the ocean at night.",
    "How do I make a good cup of coffee?",
    "Why is the sky blue?",
]
WORKLOADS = {"copy-heavy": COPY_HEAVY, "open chat": OPEN_CHAT}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(llm: LLM, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[float], list]:
    """Output tok/s, each request's TPOT (s) and the outputs' token ids, C requests at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = [[{"role": "user", "content": p}] for p in prompts[i : i + concurrency]]
        outputs += llm.chat(batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    metrics = [o.metrics for o in outputs]
    tpot = [(m.finish_time - m.first_token_time) / max(len(t) - 1, 1) for m, t in zip(metrics, tokens, strict=True)]
    return sum(map(len, tokens)) / wall, tpot, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--quantization", default="none")
    args = parser.parse_args()
    settings = dict(quantization=args.quantization, max_num_seqs=max(args.concurrency), max_model_len=2048)
    engines = {"plain": LLM(**settings), "speculative": LLM(**settings, speculative_config=args.speculative_config)}
    stats = engines["speculative"].engine.stats
    results: dict[tuple, list] = {}
    for repeat in range(args.repeats):
        for workload, prompts in WORKLOADS.items():
            for concurrency in args.concurrency:
                order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
                outputs = {}
                for name in order:
                    before = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
                    tok_s, tpot, outputs[name] = run(engines[name], prompts, concurrency, args.max_tokens)
                    after = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
                    drafts, proposed, accepted = (a - b for a, b in zip(after, before, strict=True))
                    results.setdefault((workload, concurrency, name), []).append(
                        (tok_s, statistics.median(tpot), drafts, proposed, accepted)
                    )
                    print(
                        f"repeat {repeat} {workload:10} c={concurrency} {name:11} {tok_s:6.1f} out tok/s, "
                        f"TPOT p50 {1000 * statistics.median(tpot):5.1f} ms",
                        flush=True,
                    )
                same = outputs["plain"] == outputs["speculative"]
                print(f"  outputs identical: {'yes' if same else 'NO'}", flush=True)
    print(f"\n{args.speculative_config}, quantization {args.quantization}, medians of {args.repeats}:")
    print(
        "| workload | concurrency | plain tok/s | speculative tok/s | ratio | TPOT p50 ms plain / spec | "
        "mean acceptance length | draft acceptance |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        for concurrency in args.concurrency:
            plain = results[(workload, concurrency, "plain")]
            spec = results[(workload, concurrency, "speculative")]
            p_tok, s_tok = (statistics.median(r[0] for r in rows) for rows in (plain, spec))
            p_tpot, s_tpot = (1000 * statistics.median(r[1] for r in rows) for rows in (plain, spec))
            drafts, proposed, accepted = (sum(r[i] for r in spec) for i in (2, 3, 4))
            print(
                f"| {workload} | {concurrency} | {p_tok:.1f} | {s_tok:.1f} | **{s_tok / p_tok:.2f}x** | "
                f"{p_tpot:.1f} / {s_tpot:.1f} | {1 + accepted / max(drafts, 1):.2f} | "
                f"{100 * accepted / max(proposed, 1):.0f}% |"
            )


if __name__ == "__main__":
    main()
