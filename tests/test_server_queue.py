"""A server with an API key, a queue of 8 and fewer KV pages than its sequences can use: authentication,
per-salt prefix caching, 429s, and a soak with disconnects and preemption."""

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest

from jserve.server import ServerSettings

from server_utils import MODEL, assert_error, assert_server_idle, prompt_ids, running_server, wait_until
from tiny_models import assert_engine_idle, tiny_engine_args, tiny_kv_bytes


@pytest.fixture(scope="module")
def small_server(tiny_llama_checkpoint):
    """An API key, a queue of 8, prefix caching, and a KV pool of 24 pages (384 tokens) for up to 8 sequences
    of 256."""
    settings = ServerSettings(MODEL, api_key="sesame", max_queue=8)
    args = tiny_engine_args(tiny_llama_checkpoint[0], kv_cache_memory=tiny_kv_bytes(24), enable_prefix_caching=True)
    with running_server(args, settings) as handle:
        yield handle
        assert_server_idle(handle)


def test_api_key(small_server):
    url = f"{small_server.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert_error(httpx.post(url, json=body), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(f"{small_server.base_url}/v1/models"), 401)
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer sesame"}, timeout=30).status_code == 200
    assert httpx.get(f"{small_server.base_url}/health").status_code == 200  # health needs no key


def test_cached_tokens_are_reported_per_salt(small_server):
    client = openai.OpenAI(base_url=f"{small_server.base_url}/v1", api_key="sesame", max_retries=0)
    ids = prompt_ids(77, 40)

    def cached(salt=None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    hits_before = small_server.metric("prefix_cache_hits_total")
    assert cached() == 0
    assert cached() == 32  # two whole pages; the partial third page is never shared
    assert cached("tenant") == 0
    assert small_server.metric("prefix_cache_hits_total") == hits_before + 32


def test_full_queue_gets_429(small_server):
    async def one(client, i):
        try:
            out = await client.completions.create(
                model=MODEL, prompt=prompt_ids(i), max_tokens=40, extra_body={"ignore_eos": True}
            )
            return out.usage.completion_tokens
        except openai.RateLimitError:
            return "429"

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{small_server.base_url}/v1", api_key="sesame", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(40)))

    results = asyncio.run(main())
    assert "429" in results
    assert all(r == 40 for r in results if r != "429")


def test_soak_with_disconnects_and_preemption(small_server, caplog):
    """300 requests at concurrency 64, a fifth of them abandoned at random, more KV demand than pages."""
    rng = np.random.default_rng(0)
    plans = [(prompt_ids(i, int(rng.integers(4, 60))), int(rng.integers(8, 120)), rng.random() < 0.2,
              float(rng.uniform(0.0, 0.5))) for i in range(300)]  # fmt: skip
    preempted_before = small_server.metric("num_preemptions_total")
    headers = {"Authorization": "Bearer sesame"}

    async def one(client, limit, plan):
        ids, max_tokens, abandon, after = plan
        body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        async with limit:
            for _ in range(2000):  # the queue holds 8: come back after a 429, as a client would
                try:
                    return await asyncio.wait_for(read(client, body), after) if abandon else await read(client, body)
                except asyncio.TimeoutError:
                    return "abandoned"
                except RateLimited:
                    await asyncio.sleep(0.05)
            raise AssertionError("never admitted")

    async def main():
        limit = asyncio.Semaphore(64)
        async with httpx.AsyncClient(base_url=small_server.base_url, headers=headers, timeout=120) as client:
            return await asyncio.gather(*(one(client, limit, p) for p in plans))

    async def read(client, body):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                raise RateLimited
            assert response.status_code == 200, await response.aread()
            text, finish = "", None
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
            return finish

    with caplog.at_level("WARNING"):
        results = asyncio.run(main())
    for plan, result in zip(plans, results, strict=True):
        assert result in (("length", "abandoned") if plan[2] else ("length",)), (plan, result)
    assert small_server.metric("num_preemptions_total") > preempted_before
    wait_until(lambda: not small_server.engine.engine.has_unfinished_requests())
    assert_engine_idle(small_server.engine)
    server_errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name.startswith(("jserve", "uvicorn"))]
    assert not server_errors


class RateLimited(Exception):
    pass
