"""/v1/embeddings in OpenAI's shape and /v1/score as vLLM defines it for embedding models (the cosine
similarity of text pairs), over an EmbeddingEngine. A server whose model generates answers both with a 400
saying how to serve an embedder."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jserve.errors import RequestError
from jserve.outputs import EmbeddingRequestOutput
from jserve.pooling import PoolingParams
from jserve.pooling.inputs import embedding_input, prompt_text
from jserve.pooling.vectors import pair_scores
from jserve.server.commands import PromptInput
from jserve.server.errors import APIError, bad_request

NOT_AN_EMBEDDER = (
    "this server's model generates text; {route} needs an embedding model: serve a checkpoint with "
    "sentence-transformers pooling files (modules.json), or any model with --task embed"
)


class EmbeddingRoutes:
    def __init__(self, server):
        """`server`: the OpenAIServer whose engine, checks, queue and response handling these routes share."""
        self.server = server
        self.engine = server.engine

    def routes(self) -> list[Route]:
        return [
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/score", self.score, methods=["POST"]),
        ]

    async def embeddings(self, request: Request) -> Response:
        """{"input": a text, texts, token ids or lists of them; "encoding_format": "float" | "base64";
        "dimensions": matryoshka models' cut}: OpenAI's list of embeddings with usage."""
        body = await self._read(request, "/v1/embeddings")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad_request(f"encoding_format must be 'float' or 'base64', got {encoding!r:.40}", "encoding_format")
        prompts = await run_in_threadpool(self._prompts, _inputs(body.get("input")))
        builder = EmbeddingResponses(self.server.settings.served_model_name, encoding == "base64")
        return await self._run(request, body, prompts, builder)

    async def score(self, request: Request) -> Response:
        """{"text_1": a text or texts, "text_2": texts}: the cosine similarity of each pair (text_1 against
        each of text_2 when it is one text)."""
        body = await self._read(request, "/v1/score")
        left, right = (_texts(body.get(name), name) for name in ("text_1", "text_2"))
        if len(left) != 1 and len(left) != len(right):
            raise bad_request(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many "
                              "as text_2", "text_2")  # fmt: skip
        prompts = await run_in_threadpool(self._prompts, left + right)
        builder = ScoreResponses(self.server.settings.served_model_name, len(left))
        return await self._run(request, body, prompts, builder)

    async def _read(self, request: Request, route: str) -> dict:
        body = await self.server._read_json(request)
        self.server._check_model(body.get("model"))
        if not self.engine.info.embeds:
            raise bad_request(NOT_AN_EMBEDDER.format(route=route), "model")
        return body

    def _prompts(self, inputs: list[str | list[int]]) -> list[PromptInput]:
        """Texts as sentence-transformers gives them to the model (its default prompt, if the model names one);
        token ids as they are."""
        info = self.engine.info
        prompt = prompt_text(info.pooling, None)
        prompts = []
        for item in inputs:
            if isinstance(item, str):
                text, ids = embedding_input(info.tokenizer, info.pooling, item, prompt)
                prompts.append(PromptInput(ids, text))
            else:
                prompts.append(PromptInput(item, None))
        return prompts

    async def _run(self, request: Request, body: dict, prompts: list[PromptInput], builder) -> Response:
        limit = self.server.settings.max_queue
        if len(prompts) > limit:
            raise bad_request(f"the request has {len(prompts)} inputs, more than the queue's {limit}", "input")
        if self.engine.num_queued + len(prompts) > limit:
            raise APIError(429, f"the queue is full ({limit} sequences waiting); retry later")
        priority = body.get("priority", 0)
        try:
            params = PoolingParams(body.get("dimensions"))
            submission = await self.engine.submit(prompts, params, priority)
        except RequestError as err:
            raise bad_request(str(err), "input" if err.param == "prompt" else err.param) from None
        return await self.server._respond(request, submission, builder)


class EmbeddingResponses:
    def __init__(self, model: str, as_base64: bool):
        self.model, self.as_base64 = model, as_base64

    def response(self, outputs: list[EmbeddingRequestOutput]) -> dict:
        data = [{"object": "embedding", "index": i, "embedding": self._encode(out.outputs.embedding)}
                for i, out in enumerate(outputs)]  # fmt: skip
        return _listing("embd", self.model, data, outputs)

    def _encode(self, vector: list[float]) -> list[float] | str:
        """base64: the float32 values' little-endian bytes, as OpenAI's clients decode them."""
        if not self.as_base64:
            return vector
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()


class ScoreResponses:
    def __init__(self, model: str, num_left: int):
        self.model, self.num_left = model, num_left

    def response(self, outputs: list[EmbeddingRequestOutput]) -> dict:
        scores = pair_scores([out.outputs.embedding for out in outputs], self.num_left)
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return _listing("score", self.model, data, outputs)


def _listing(kind: str, model: str, data: list[dict], outputs: list[EmbeddingRequestOutput]) -> dict:
    """The response around `data`, with the inputs' tokens as its usage."""
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": usage}  # fmt: skip


def _inputs(value) -> list[str | list[int]]:
    """OpenAI's `input`: a text, a list of texts, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a text, a list of texts, token ids or a list of token-id lists", "input")
    for item in value:
        if isinstance(item, str):
            if not item:
                raise bad_request("input holds an empty text", "input")
        elif not (isinstance(item, list) and item and all(_is_id(t) for t in item)):
            raise bad_request("input must be texts or non-empty lists of token ids", "input")
    if len({isinstance(item, str) for item in value}) > 1:
        raise bad_request("input mixes texts and token ids; send one kind per request", "input")
    return value


def _texts(value, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad_request(f"{name} must be a text or a non-empty list of texts", name)
    return texts


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
