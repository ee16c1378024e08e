"""The Starlette app: OpenAI-compatible routes over an AsyncEngine, with auth, size limits and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, replace

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import jserve
from jserve.engine.args import EngineArgs
from jserve.errors import EngineAsleepError, RequestError, short_repr
from jserve.lora import LoRARequest
from jserve.server.async_engine import AsyncEngine, EngineState
from jserve.server.commands import PromptInput
from jserve.server.embedding_routes import EmbeddingRoutes
from jserve.server.errors import APIError, bad_request
from jserve.server.lora_routes import LoRARoutes
from jserve.server.metrics import ServerMetrics
from jserve.server.protocol import GenerationRequest, parse_chat, parse_completion, parse_tokenize
from jserve.server.request_body import read_json_object
from jserve.server.responses import ChatResponses, CompletionResponses, ResponseBuilder
from jserve.server.submission import EngineError, Submission
from jserve.server.weight_routes import WeightRoutes
from jserve.tools import get_tool_parser
from jserve.tools.chat_tools import ChatTools
from jserve.tools.extract import ToolCalls

UNPROTECTED_PATHS = {"/health", "/metrics", "/version"}


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queue: int = 1024  # sequences (prompts × n) accepted but not yet generating; beyond it new ones get 429
    max_body_bytes: int = 16 << 20
    chat_template: str | None = None  # overrides the checkpoint's
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, its calls read by the parser
    tool_call_parser: str | None = None  # one of jserve.tools.TOOL_PARSERS
    enable_weight_routes: bool = False  # /v1/update_weights, /sleep, /wake_up, /is_sleeping (weight_routes.py)
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_routes.py)


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.created = int(time.time())
        # Keys are compared as digests: equal lengths, so the comparison's time tells nothing about the key.
        self.key_digest = _digest(f"Bearer {settings.api_key}") if settings.api_key is not None else None

    # --- routes ----------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        gen = parse_completion(await self._read_json(request))
        self._check_generates(gen.model)
        lora = self._lora_request(gen.model)
        prompts = await run_in_threadpool(self._completion_prompts, gen)
        echo = [p.text or "" for p in prompts] if gen.echo else None
        tokenizer = self.engine.info.tokenizer
        name = lora.lora_name if lora else self.settings.served_model_name  # (vLLM answers with the adapter's)
        builder = CompletionResponses(
            name, gen.params.n, echo_texts=echo, prompt_logprobs=gen.return_prompt_logprobs,
            prompt_only=gen.prompt_only, decode=lambda t: tokenizer.decode([t], skip_special_tokens=False),
        )  # fmt: skip
        return await self._generate(request, gen, prompts, builder, lora)

    async def chat_completions(self, request: Request) -> Response:
        gen = parse_chat(await self._read_json(request))
        self._check_generates(gen.model)
        lora = self._lora_request(gen.model)
        tools = self._tool_calls(gen)
        prompts = [await run_in_threadpool(self._chat_request_prompt, gen)]
        name = lora.lora_name if lora else self.settings.served_model_name
        builder = ChatResponses(name, gen.params.n, gen.params.logprobs or 0, tools,
                                prompt_logprobs=gen.return_prompt_logprobs)  # fmt: skip
        return await self._generate(request, gen, prompts, builder, lora)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        name = self.settings.served_model_name
        root = str(self.engine.args.model or name)
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "jserve", "root": root}
        if (info := self.engine.info) is not None:
            card["max_model_len"] = info.max_model_len
            card["task"] = "embed" if info.embeds else "generate"  # what the model does here
            if info.embeds:
                card["embedding_dimension"] = info.dimension
        cards = [card]
        if info is not None and info.serves_adapters:
            adapters = await self.engine.call(lambda engine: [(a.name, a.path) for a in engine.adapters])
            cards += [{"id": adapter, "object": "model", "created": self.created, "owned_by": "jserve", "root": path,
                       "parent": name, "max_model_len": info.max_model_len, "task": "generate"}
                      for adapter, path in adapters]  # fmt: skip
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, request: Request) -> Response:
        state = self.engine.state
        status = 200 if state is EngineState.READY else 503
        return JSONResponse({"status": state.value}, status_code=status)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": jserve.__version__})

    async def tokenize(self, request: Request) -> Response:
        body = parse_tokenize(await self._read_json(request))
        self._check_model(body.model)
        if body.messages is not None:
            chat = ChatTools(None, self.engine.info.tokenizer.chat_template)
            prompt = await run_in_threadpool(self._chat_prompt, body.messages, body.add_generation_prompt, chat)
            tokens = prompt.token_ids
        else:
            tokens = await run_in_threadpool(self.engine.info.tokenizer.encode, body.prompt, body.add_special_tokens)
        return JSONResponse({"count": len(tokens), "max_model_len": self.engine.info.max_model_len, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        body = await self._read_json(request)
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = self.engine.info.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise bad_request(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": await run_in_threadpool(self.engine.info.tokenizer.decode, tokens)})

    # --- generation ------------------------------------------------------------------------------

    async def _generate(self, request: Request, gen: GenerationRequest, prompts: list[PromptInput],
                        builder: ResponseBuilder, lora: LoRARequest | None = None) -> Response:  # fmt: skip
        _check_fits(gen, prompts, self.engine.info.max_model_len)
        sequences, limit = len(prompts) * gen.params.n, self.settings.max_queue
        if sequences > limit:
            raise bad_request(f"the request asks for {sequences} sequences (prompts × n), more than the queue's "
                              f"{limit}", "n")  # fmt: skip
        if self.engine.num_queued + sequences > limit:
            raise APIError(429, f"the queue is full ({limit} sequences waiting); retry later")
        try:
            submission = await self.engine.submit(prompts, gen.params, gen.priority, gen.cache_salt, lora)
        except RequestError as err:  # the engine's checks; a grammar that does not compile names the field it came in
            if err.param == "lora_request":  # (an adapter named as the model, unloaded since it was checked)
                raise self._no_model(gen.model) from None
            raise bad_request(
                str(err), gen.structured_param if err.param == "structured_outputs" else err.param
            ) from None
        except EngineAsleepError as err:
            raise APIError(503, str(err)) from None
        if gen.stream:
            builder.count_prompts([len(p.token_ids) for p in prompts])
            return StreamingResponse(self._stream(submission, builder, gen), media_type="text/event-stream")
        return await self._respond(request, submission, builder)

    async def _respond(self, request: Request, submission: Submission, builder: ResponseBuilder) -> Response:
        """Wait for the whole result, aborting it if the client goes away first."""
        results = asyncio.ensure_future(submission.results())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():
                return Response(status_code=499)  # nobody is listening; the request is aborted below
            try:
                return JSONResponse(builder.response(results.result()))
            except EngineError as err:
                raise APIError(500, str(err)) from None
        finally:
            for task in (results, gone):
                task.cancel()
            submission.abort()

    async def _stream(self, submission: Submission, builder: ResponseBuilder, gen: GenerationRequest):
        """Server-sent events; Starlette cancels this generator when the client disconnects."""
        try:
            if isinstance(builder, ChatResponses):
                yield _sse(_with_usage(builder.role_chunk(gen.num_prompts), gen, builder))
            async for out in submission:
                for chunk in builder.chunks(submission.prompt_index(out), out):
                    yield _sse(_with_usage(chunk, gen, builder))
            if gen.include_usage:
                yield _sse(builder.usage_chunk())
        except EngineError as err:
            yield _sse(APIError(500, str(err)).to_dict())
        finally:
            submission.abort()
        yield "data: [DONE]\n\n"

    # --- helpers ---------------------------------------------------------------------------------

    def _completion_prompts(self, gen: GenerationRequest) -> list[PromptInput]:
        tokenizer = self.engine.info.tokenizer
        prompts = []
        for prompt in gen.prompts:
            if isinstance(prompt, str):
                prompts.append(PromptInput(tokenizer.encode(prompt), prompt))
            else:
                # echoed as vLLM echoes token ids: every token's text, special tokens too
                text = tokenizer.decode(prompt, skip_special_tokens=False) if gen.echo else None
                prompts.append(PromptInput(prompt, text))
        return prompts

    def _tool_calls(self, gen: GenerationRequest) -> ToolCalls | None:
        """How the request's output becomes tool calls."""
        use = gen.tool_use
        if use is None:
            return None
        if use.choice.mode == "auto" and not (self.settings.enable_auto_tool_choice and self.settings.tool_call_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                              "tool_choice")  # fmt: skip
        parser = self.settings.tool_call_parser
        return ToolCalls(use, get_tool_parser(parser) if parser else None)

    def _chat_request_prompt(self, gen: GenerationRequest) -> PromptInput:
        """A chat request's prompt, its tools prepared as LLM.chat prepares them: a forced call's grammar goes
        into its params."""
        try:
            chat = ChatTools(gen.tool_use, self.engine.info.tokenizer.chat_template)
            gen.params = replace(gen.params, structured_outputs=chat.constraint(gen.params.structured_outputs))
        except RequestError as err:
            raise bad_request(str(err), err.param) from None
        if chat.forced is not None:
            gen.structured_param = "tools"  # where a grammar that does not compile came from
        return self._chat_prompt(gen.messages, gen.add_generation_prompt, chat)

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool, chat: ChatTools) -> PromptInput:
        tokenizer = self.engine.info.tokenizer
        messages, template_tools = chat.template_inputs(messages)
        try:
            text, token_ids = tokenizer.encode_chat(messages, add_generation_prompt, tools=template_tools)
        except ValueError as err:
            raise bad_request(str(err), "messages") from None
        return PromptInput(token_ids, text)

    async def _read_json(self, request: Request) -> dict:
        self._authorize(request)
        return await read_json_object(request, self.settings.max_body_bytes)

    def _authorize(self, request: Request) -> None:
        if self.key_digest is None or request.url.path in UNPROTECTED_PATHS:
            return
        if not hmac.compare_digest(_digest(request.headers.get("authorization", "")), self.key_digest):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        self._check_ready()  # so handlers may read self.engine.info
        if model is not None and model != self.settings.served_model_name and not self.engine.info.serves_adapters:
            raise self._no_model(model)

    def _no_model(self, model: str) -> APIError:
        adapters = " or one of its LoRA adapters (GET /v1/models)" if self.engine.info.serves_adapters else ""
        return APIError(404, f"the model {short_repr(model)} does not exist; this server serves "
                        f"'{self.settings.served_model_name}'{adapters}", "model", "model_not_found")  # fmt: skip

    def _lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (checked as the engine queues it), or None for the base model."""
        if model is None or model == self.settings.served_model_name:
            return None
        return LoRARequest(model)

    def _check_generates(self, model: str | None) -> None:
        self._check_model(model)
        if self.engine.info.embeds:
            raise bad_request("this server's model is an embedding model (task embed): it makes vectors "
                              "(POST /v1/embeddings), not text", "model")  # fmt: skip

    def _check_ready(self) -> None:
        state = self.engine.state
        if state is not EngineState.READY:
            reason = {EngineState.LOADING: "the model is still loading", EngineState.DRAINING: "the server is "
                      "shutting down"}.get(state, "the engine is not running")  # fmt: skip
            raise APIError(503, reason)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _check_fits(gen: GenerationRequest, prompts: list[PromptInput], max_model_len: int) -> None:
    """Prompt plus max_tokens must fit the context: vLLM refuses, rather than cut, a completion that cannot."""
    max_tokens = gen.params.max_tokens
    longest = max(len(p.token_ids) for p in prompts)
    if max_tokens is not None and longest < max_model_len < longest + max_tokens:
        raise bad_request(f"{gen.max_tokens_param} is too large: {max_tokens}. This model's maximum context length "
                          f"is {max_model_len} tokens and the prompt has {longest} ({max_tokens} > {max_model_len} "
                          f"- {longest})", gen.max_tokens_param)  # fmt: skip


def _with_usage(chunk: dict, gen: GenerationRequest, builder: ResponseBuilder) -> dict:
    """With continuous_usage_stats, vLLM puts the usage so far on every chunk; with include_usage alone,
    OpenAI puts "usage": null on every chunk before the final usage chunk."""
    if gen.continuous_usage:
        return chunk | {"usage": builder.usage()}
    return chunk | {"usage": None} if gen.include_usage else chunk


def _sse(payload: dict) -> str:
    # ASCII escapes keep U+2028, U+0085 and friends out of the stream: clients that split lines
    # with str.splitlines (httpx's aiter_lines) would otherwise cut an event in two.
    return f"data: {json.dumps(payload)}\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(request: Request, err: APIError) -> Response:
    return err.response()


async def _http_error(request: Request, err: HTTPException) -> Response:
    message = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} not allowed"}
    return APIError(err.status_code, message.get(err.status_code, str(err.detail))).response()


async def _client_gone(request: Request, err: ClientDisconnect) -> Response:
    return Response(status_code=499)  # nobody reads it; nothing was queued


async def _server_error(request: Request, err: Exception) -> Response:
    return APIError(500, f"internal error: {type(err).__name__}: {err}").response()


def build_app(engine_args: EngineArgs, settings: ServerSettings) -> Starlette:
    """The app, with its engine (started on app start-up, stopped on shutdown) at `app.state.engine`."""
    engine = AsyncEngine(engine_args, ServerMetrics(settings.served_model_name), settings.chat_template)
    server = OpenAIServer(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        yield
        engine.begin_drain()
        await run_in_threadpool(engine.shutdown)

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
    ]
    routes += EmbeddingRoutes(server).routes()
    if settings.enable_weight_routes:
        routes += WeightRoutes(server).routes()
    if settings.allow_runtime_lora_updating:
        routes += LoRARoutes(server).routes()
    handlers = {APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone,
                Exception: _server_error}  # fmt: skip
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.engine = engine
    return app
