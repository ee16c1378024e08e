"""Routes for a trainer in another process (off unless `--enable-weight-routes`): new weights from a
checkpoint folder, and sleep / wake to hand the device's memory over between rollouts. Named as vLLM's
development routes are (`/sleep`, `/wake_up`, `/is_sleeping`), API-key protected like the others."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jserve.errors import WeightUpdateError
from jserve.loader.weight_update import updated_params
from jserve.server.errors import APIError, bad_request


class WeightRoutes:
    def __init__(self, server):
        """`server`: the OpenAIServer whose engine, checks and body reading these routes share."""
        self.server = server
        self.engine = server.engine

    def routes(self) -> list[Route]:
        return [
            Route("/v1/update_weights", self.update_weights, methods=["POST"]),
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping, methods=["GET"]),
        ]

    async def update_weights(self, request: Request) -> Response:
        """{"path": a Hugging Face or `jserve convert` folder on the server's machine}. Requests sent after the
        answer run on the new weights (those in flight finish on the old ones); it says their version."""
        body = await self._read(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise bad_request("path must name a checkpoint folder on the server's machine", "path")
        model = await self.engine.call(lambda engine: engine.model)
        try:  # read, cast and placed off the engine thread, which keeps serving meanwhile
            params = await run_in_threadpool(updated_params, model, path)
        except WeightUpdateError as err:
            raise bad_request(str(err), "path") from None
        swapped, version = await self.engine.call(
            lambda engine: (engine.update_weights(params), engine.weights.version)
        )
        return JSONResponse({"weights_version": version if swapped else version + 1})

    async def sleep(self, request: Request) -> Response:
        self._allow(request)
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise bad_request("level must be 1 or 2", "level")
        try:
            await self.engine.call(lambda engine: engine.sleep(int(level)))
        except RuntimeError as err:  # requests still running
            raise APIError(409, str(err)) from None
        return JSONResponse({"is_sleeping": True})

    async def wake_up(self, request: Request) -> Response:
        self._allow(request)
        await self.engine.call(lambda engine: engine.wake_up())
        return JSONResponse({"is_sleeping": False})

    async def is_sleeping(self, request: Request) -> Response:
        self._allow(request)
        return JSONResponse({"is_sleeping": await self.engine.call(lambda engine: engine.weights.sleeping)})

    async def _read(self, request: Request) -> dict:
        body = await self.server._read_json(request)  # (authorized there)
        self._check_serving()
        return body

    def _allow(self, request: Request) -> None:
        self.server._authorize(request)
        self._check_serving()

    def _check_serving(self) -> None:
        self.server._check_ready()
        if self.engine.info.embeds:
            raise bad_request("new weights and sleep serve training loops of models that generate; this server's "
                              "model is an embedding model")  # fmt: skip
