"""vLLM's routes for adapters at run time (off unless --allow-runtime-lora-updating): load a PEFT folder
under a name requests then give as their model, and unload it. The folder is read off the engine thread;
only registering the name runs on it. Unloading stops new requests naming the adapter; those already
queued or running finish with it."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jserve.lora import AdapterError
from jserve.server.errors import APIError, bad_request


class LoRARoutes:
    def __init__(self, server):
        """`server`: the OpenAIServer whose engine, checks and body reading these routes share."""
        self.server = server
        self.engine = server.engine

    def routes(self) -> list[Route]:
        return [
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
        ]

    async def load(self, request: Request) -> Response:
        """{"lora_name": the model name requests will give, "lora_path": a PEFT folder on the server's machine
        or a hub id}."""
        body = await self._read(request)
        name, path = self._field(body, "lora_name"), self._field(body, "lora_path")
        registry = await self.engine.call(lambda engine: engine.adapters)
        if name == self.server.settings.served_model_name or registry.get(name) is not None:
            raise bad_request(f"the name {name!r} is taken: unload that adapter first, or choose another", "lora_name")
        try:
            adapter = await run_in_threadpool(registry.read, name, path)
            await self.engine.call(lambda engine: engine.adapters.add(adapter))
        except AdapterError as err:
            raise bad_request(str(err), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        """{"lora_name": an adapter loaded by name}."""
        body = await self._read(request)
        name = self._field(body, "lora_name")
        try:
            await self.engine.call(lambda engine: engine.adapters.unregister(name))
        except AdapterError as err:
            raise APIError(404, str(err), "lora_name", "model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _read(self, request: Request) -> dict:
        body = await self.server._read_json(request)  # (authorized there)
        self.server._check_ready()
        if not self.engine.info.serves_adapters:
            raise bad_request("this server serves no LoRA adapters: start it with --enable-lora")
        return body

    @staticmethod
    def _field(body: dict, name: str) -> str:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise bad_request(f"{name} must be a non-empty string", name)
        return value
