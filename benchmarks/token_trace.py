"""The tokens of mixed workloads, to show that two versions of jserve generate the same ones.

Each workload runs one engine configuration on the default model over the same requests: shared prefixes,
n > 1, greedy, seeded and unseeded sampling, penalties, min_tokens with logit bias, stop strings, logprobs and
grammars (JSON schema, regex, choice). The configurations cover the admission policies (fcfs, lpm, priority),
async scheduling on and off, a KV cache small enough to evict cached pages and preempt requests, and n-gram
and draft-model speculation. `--baseline REV` runs the same workloads against the jserve of git revision REV
(checked out in a temporary worktree) in a child process, then compares every completion's token ids.

    python benchmarks/token_trace.py --baseline ed9f596
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
PREFIX = "You are a careful assistant. Answer in one short sentence, and never use lists or headings. "
TOPICS = ["the moon", "rivers", "bread", "a violin", "winter", "bees", "glass", "a lighthouse"]
REPEATING = "one two three four five six seven eight one two three four five six seven eight one two three"


def workloads(default_model: str) -> dict[str, dict]:
    draft = {"model": default_model, "num_speculative_tokens": 3}
    return {
        "fcfs": {},
        "lpm": {"schedule_policy": "lpm"},
        "priority": {"schedule_policy": "priority"},
        "async-off": {"async_scheduling": False},
        "evict-and-preempt": {"kv_cache_memory": 7 * 2**20, "max_model_len": 128},
        "ngram": {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        },  # fmt: skip
        "draft-model": {"speculative_config": draft},
    }


def requests():
    """(prompt, SamplingParams, priority) for every request of a workload."""
    from jserve import SamplingParams

    options = [
        dict(temperature=0, max_tokens=24, ignore_eos=True),
        dict(temperature=0.8, top_p=0.9, seed=1, n=2, max_tokens=20),
        dict(temperature=1.0, max_tokens=16),  # seeded by the engine
        dict(
            temperature=0.7, seed=5, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=20
        ),  # fmt: skip
        dict(temperature=0, min_tokens=6, logit_bias={13: -100.0, 30: 2.0}, max_tokens=16),
        dict(temperature=0, stop=["."], max_tokens=32, logprobs=2),
        dict(temperature=0.6, seed=9, top_k=20, max_tokens=40, structured_outputs={"json": SCHEMA}),
        dict(temperature=0, max_tokens=12, structured_outputs={"regex": "[0-9]{3}-[a-z]{4}"}),
        dict(temperature=0.9, seed=3, max_tokens=8, structured_outputs={"choice": ["yes", "no", "maybe"]}),
        dict(temperature=0, max_tokens=32, ignore_eos=True),
    ]
    out = []
    for i, topic in enumerate(TOPICS * 2):
        prompt = REPEATING if i % 5 == 4 else f"{PREFIX}Here is a short paragraph about {topic}:"
        out.append((prompt, SamplingParams(**options[i % len(options)]), i % 3))
    return out


def trace(names: list[str]) -> dict:
    """{workload: {"tokens": [[ids of each completion] per request], "preemptions": n, "seconds": s}}."""
    from jserve import LLM
    from jserve.loader.default_model import default_model_path

    result = {}
    for name, settings in workloads(str(default_model_path())).items():
        if names and name not in names:
            continue
        settings = {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 128, **settings}
        llm = LLM(None, **settings)
        reqs = requests()
        start = time.perf_counter()
        priority = [p for _, _, p in reqs] if settings.get("schedule_policy") == "priority" else None
        outputs = llm.generate([p for p, _, _ in reqs], [s for _, s, _ in reqs], use_tqdm=False, priority=priority)
        result[name] = {
            "tokens": [[list(c.token_ids) for c in out.outputs] for out in outputs],
            "preemptions": llm.engine.stats.preemptions,
            "seconds": time.perf_counter() - start,
        }
        print(f"{name}: {len(outputs)} requests in {result[name]['seconds']:.1f}s, {llm.engine.config.num_pages} "
              f"pages, {result[name]['preemptions']} preemptions", file=sys.stderr, flush=True)  # fmt: skip
        del llm
    return result


def run_baseline(revision: str, names: list[str]) -> dict:
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), revision], check=True,
                       capture_output=True)  # fmt: skip
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            command = [sys.executable, __file__, "--json", *(["--only", *names] if names else [])]
            done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, cwd=tmp)
            return json.loads(done.stdout)
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)


def compare(ours: dict, theirs: dict) -> int:
    """Print each workload's verdict; returns the number of completions that differ."""
    differing = 0
    for name, entry in ours.items():
        pairs = list(zip(entry["tokens"], theirs[name]["tokens"], strict=True))
        completions = sum(len(a) for a, _ in pairs)
        differ = sum(x != y for a, b in pairs for x, y in zip(a, b, strict=True))
        differing += differ
        verdict = "identical" if not differ else f"{differ} of {completions} completions differ"
        print(f"| {name} | {completions} | {entry['preemptions']} / {theirs[name]['preemptions']} | {verdict} |")
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="git revision to compare with")
    parser.add_argument("--only", nargs="*", default=[], help="workloads to run (default: all)")
    parser.add_argument("--json", action="store_true", help="print the trace as JSON (for --baseline)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(trace(args.only)))
        return
    theirs = run_baseline(args.baseline, args.only) if args.baseline else None
    ours = trace(args.only)
    if theirs is None:
        print(json.dumps(ours))
        return
    print(f"\n| workload | completions | preemptions (this / {args.baseline}) | tokens |\n| --- | --- | --- | --- |")
    sys.exit(1 if compare(ours, theirs) else 0)


if __name__ == "__main__":
    main()
