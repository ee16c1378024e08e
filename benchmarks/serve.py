"""Serving benchmark against any OpenAI-compatible server (jserve, vLLM, llama.cpp's llama-server).

Requests go to /v1/completions with streaming, greedy, ignore_eos, arriving as a Poisson (or gamma, with
--burstiness) process at --request-rate, or all at once, optionally capped by --max-concurrency. Datasets:
`random` (random token ids, lengths uniform in ranges) and `shared-prefix` (groups of prompts that share
a long system prompt, then a question of their own). Prints a vLLM-style summary.

Without --base-url it starts `jserve serve` itself (extra server flags go in --server-args):

    python benchmarks/serve.py --num-prompts 64 --input-len 112 144 --output-len 128 128 --max-concurrency 16
    python benchmarks/serve.py --base-url http://127.0.0.1:8080 --model any   # e.g. llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_jobs(args, rng) -> list[Job]:
    lens = rng.integers(args.input_len[0], args.input_len[1] + 1, args.num_prompts)
    outs = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_prompts)
    return [Job(rng.integers(100, 20000, n).tolist(), int(m)) for n, m in zip(lens, outs, strict=True)]


def shared_prefix_jobs(args, rng) -> list[Job]:
    jobs = []
    for _ in range(args.num_groups):
        system = rng.integers(100, 20000, args.system_prompt_len).tolist()
        for _ in range(args.prompts_per_group):
            jobs.append(Job(system + rng.integers(100, 20000, args.question_len).tolist(), args.output_len[1]))
    order = rng.permutation(len(jobs))
    return [jobs[i] for i in order]


async def send(client: httpx.AsyncClient, model: str, job: Job) -> Outcome:
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    out = Outcome(ok=False, prompt_tokens=len(job.prompt))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    out.output_tokens = data["usage"]["completion_tokens"]
                if not data.get("choices") or not data["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last, chunks = now, chunks + 1
    except httpx.HTTPError as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    out.latency = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks
    out.ok = True
    return out


async def run(args, jobs: list[Job]) -> tuple[list[Outcome], float]:
    rng = np.random.default_rng(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(jobs))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No keep-alive: llama-server closes idle connections, and a reused closed one fails the request.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=3600, limits=limits) as client:

        async def limited(job: Job) -> Outcome:
            async with limit:
                return await send(client, args.model, job)

        tasks, start = [], time.perf_counter()
        for job in jobs:
            tasks.append(asyncio.create_task(limited(job)))
            if args.request_rate != float("inf"):  # gamma intervals; burstiness 1 = Poisson
                shape = args.burstiness
                await asyncio.sleep(rng.gamma(shape, 1 / (args.request_rate * shape)))
        outcomes = await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], seconds: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    ms = lambda values, q: 1000 * float(np.percentile(values, q)) if values else float("nan")  # noqa: E731
    ttft = [o.ttft for o in ok]
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itl = [x for o in ok for x in o.itl]
    output = sum(o.output_tokens for o in ok)
    summary = {
        "successful requests": len(ok),
        "failed requests": len(outcomes) - len(ok),
        "duration s": seconds,
        "request throughput req/s": len(ok) / seconds,
        "output throughput tok/s": output / seconds,
        "total throughput tok/s": (output + sum(o.prompt_tokens for o in ok)) / seconds,
    }
    for name, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl)):
        summary[f"mean {name} ms"] = 1000 * float(np.mean(values)) if values else float("nan")
        summary[f"median {name} ms"] = ms(values, 50)
        summary[f"p99 {name} ms"] = ms(values, 99)
    errors = [o.error for o in outcomes if not o.ok]
    if errors:
        summary["first error"] = errors[0]
    return summary


def print_summary(summary: dict) -> None:
    print("=" * 20 + " serving benchmark " + "=" * 20)
    for key, value in summary.items():
        print(f"{key:<32} {value:>14.2f}" if isinstance(value, float) else f"{key:<32} {value!s:>14}")


def launch_jserve(args) -> subprocess.Popen:
    port = 8000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "jserve", "serve", "--port", str(port), *shlex.split(args.server_args)]
    print("launching:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    args.base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{args.base_url}/health").status_code == 200:
                args.model = httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"jserve serve exited with {proc.returncode}")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("jserve serve did not become ready in 900 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server; default: launch jserve serve")
    parser.add_argument("--server-args", default="", help="flags for the launched jserve serve")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(112, 144), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--num-groups", type=int, default=16)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    args = parser.parse_args()

    proc = launch_jserve(args) if args.base_url is None else None
    try:
        if args.model is None:
            args.model = httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
        rng = np.random.default_rng(args.seed)
        jobs = random_jobs(args, rng) if args.dataset == "random" else shared_prefix_jobs(args, rng)
        outcomes, seconds = asyncio.run(run(args, jobs))
        summary = summarize(outcomes, seconds)
        print_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)


if __name__ == "__main__":
    main()
