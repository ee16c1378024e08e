"""What the event loop tells the engine thread: one frozen dataclass per command, applied between steps.

Handlers put these on AsyncEngine's queue and never touch the engine; the engine thread takes them in
order and dispatches on their type (`AsyncEngine._take_commands`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jserve.lora import LoRARequest
from jserve.pooling import PoolingParams
from jserve.sampling_params import SamplingParams
from jserve.server.submission import Submission


@dataclass(frozen=True)
class PromptInput:
    token_ids: list[int]
    text: str | None  # shown in outputs (echo); None for token-id prompts


@dataclass(frozen=True)
class AddRequests:
    """Queue one engine request per prompt, all or none: a refused prompt withdraws the others."""

    submission: Submission  # its request ids, one per prompt, and where their outputs go
    prompts: list[PromptInput]
    params: SamplingParams | PoolingParams  # PoolingParams: inputs to embed
    priority: int
    cache_salt: str | None
    lora_request: LoRARequest | None  # the adapter the prompts run with (None: the base model)
    accepted: asyncio.Future[None]  # settled on the event loop: a result once queued, the refusal if not


@dataclass(frozen=True)
class AbortRequests:
    """Abort these requests (their KV pages are freed within a step); finished or unknown ids are ignored."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CallEngine:
    """Run `call(engine)` between steps (sleep, wake_up, new weights); its result or error settles `done`."""

    call: Callable[[Any], Any]
    done: asyncio.Future


@dataclass(frozen=True)
class Stop:
    """Fail what is still in flight and end the engine thread."""


Command = AddRequests | AbortRequests | CallEngine | Stop
