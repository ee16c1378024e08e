"""jserve against a peer OpenAI-compatible server (llama.cpp's llama-server) on one workload, in one run.

At each concurrency the servers take turns on the same requests (jserve, peer, jserve, peer, ...), so
drifting machine load hits both alike; the table gives medians over --repeats of output tok/s, TTFT and
ITL p50 / p99, and the jserve / peer throughput ratio. jserve is started here (--server-args); the peer
must be running already, and freshly started: prompts depend only on --seed, and llama-server keeps each
slot's last prompt cached, so a second invocation against the same peer finds its prompts cached.

    ../shared/peer/start_llama_server.sh 8080        # llama-server -np 16 on 127.0.0.1:8080
    python benchmarks/peer.py --peer-url http://127.0.0.1:8080 --server-args "--quantization int8"
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import numpy as np
from serve import launch_jserve, random_jobs, run, summarize

METRICS = ("output throughput tok/s", "median TTFT ms", "p99 TTFT ms", "median ITL ms", "p99 ITL ms")


def workload(args, num_prompts: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "num_prompts": num_prompts})


def measure(args, base_url: str, model: str, concurrency: int, jobs) -> dict:
    settings = argparse.Namespace(**{**vars(args), "base_url": base_url, "model": model,
                                     "max_concurrency": concurrency, "request_rate": float("inf")})  # fmt: skip
    summary = summarize(*asyncio.run(run(settings, jobs)))
    if summary["failed requests"]:
        raise SystemExit(f"{base_url}: {summary['failed requests']} requests failed: {summary['first error']}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-url", required=True)
    parser.add_argument("--peer-name", default="llama-server")
    parser.add_argument("--server-args", default="", help="flags for the launched jserve serve")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-prompts-at-1", type=int, default=8, help="requests at concurrency 1 (sequential)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(112, 144), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--json", default=None, help="also write every run's summary to this file")
    args = parser.parse_args()

    jserve = argparse.Namespace(**vars(args), base_url=None, model=None)
    proc = launch_jserve(jserve)
    servers = {"jserve": (jserve.base_url, jserve.model)}
    servers[args.peer_name] = (args.peer_url, httpx.get(f"{args.peer_url}/v1/models").json()["data"][0]["id"])
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        measure(args, *servers["jserve"], 2, random_jobs(workload(args, 2), np.random.default_rng(99)))  # warm-up
        for concurrency in args.concurrency:
            count = args.num_prompts_at_1 if concurrency == 1 else args.num_prompts
            for repeat in range(args.repeats):
                # Fresh prompts each repeat, the same for both servers: neither finds them cached.
                jobs = random_jobs(workload(args, count), np.random.default_rng([args.seed, concurrency, repeat]))
                for name, (url, model) in servers.items():
                    summary = measure(args, url, model, concurrency, jobs)
                    runs.setdefault((name, concurrency), []).append(summary)
                    print(f"concurrency {concurrency}, repeat {repeat + 1}: {name} "
                          f"{summary['output throughput tok/s']:.1f} tok/s", flush=True)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=120)

    print(
        f"\n{args.input_len[0]}-{args.input_len[1]} prompt + {args.output_len[0]}-{args.output_len[1]} output "
        f"tokens, medians of {args.repeats} alternating runs"
    )
    print(
        f"{'server':<14} {'conc':>4} {'reqs':>4} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}  jserve/peer"
    )
    for concurrency in args.concurrency:
        medians = {
            name: {m: float(np.median([r[m] for r in runs[name, concurrency]])) for m in METRICS} for name in servers
        }
        ratio = medians["jserve"][METRICS[0]] / medians[args.peer_name][METRICS[0]]
        for name, m in medians.items():
            print(
                f"{name:<14} {concurrency:>4} {runs[name, concurrency][0]['successful requests']:>4} "
                f"{m[METRICS[0]]:>9.1f} {m[METRICS[1]]:>9.0f} {m[METRICS[2]]:>9.0f} {m[METRICS[3]]:>8.0f} "
                f"{m[METRICS[4]]:>8.0f}" + (f"  {ratio:.2f}x" if name == "jserve" else "")
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{name} c{c}": r for (name, c), r in runs.items()}, f, indent=2)


if __name__ == "__main__":
    main()
