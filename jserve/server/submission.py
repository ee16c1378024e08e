"""One HTTP call's engine requests (one per prompt), as the event loop reads their outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from jserve.outputs import RequestOutput


class EngineError(RuntimeError):
    """The engine failed while running this request (not the request's fault)."""


class Submission:
    """The engine requests of one HTTP call (one per prompt), read from the event loop as they progress."""

    def __init__(self, request_ids: list[str], n: int, on_abort: Callable[[Submission, bool], None]):
        """`on_abort(submission, unfinished)`: the engine's side of `abort` (stop routing to it, and abort its
        requests when some are unfinished)."""
        self.request_ids, self.n, self._on_abort = request_ids, n, on_abort
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unstarted = set(request_ids)  # no output yet: their n sequences each count against --max-queue
        self.latest: dict[str, RequestOutput] = {}
        self.closed = False

    def prompt_index(self, out: RequestOutput) -> int:
        return self.request_ids.index(out.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Every output as it comes, until all this call's requests have finished."""
        pending = set(self.request_ids)
        while pending:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, RequestOutput) and any(c.finish_reason == "error" for c in item.outputs):
                raise EngineError(
                    "the engine failed while running this request (the server log says why); "
                    "other requests were not affected"
                )
            self.latest[item.request_id] = item
            if item.finished:
                pending.discard(item.request_id)
            yield item
        self.closed = True

    async def results(self) -> list[RequestOutput]:
        """The finished outputs, in prompt order."""
        async for _ in self:
            pass
        return [self.latest[i] for i in self.request_ids]

    def abort(self) -> None:
        """End this call: abort whatever has not finished (their KV pages are freed within a step)."""
        unfinished, self.closed = not self.closed, True
        self._on_abort(self, unfinished)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.unstarted.discard(item.request_id)
        self.queue.put_nowait(item)
