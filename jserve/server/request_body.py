"""Read a POST body into a JSON object, refusing first whatever could crash or exhaust the server.

415 unless the body is declared `application/json` (a browser page cannot send that to a local server
without a CORS preflight, which this server never answers); 413 past the size limit; 400 for invalid
JSON, nesting deeper than MAX_JSON_DEPTH, or strings that are not valid Unicode (lone surrogates, which
JSON's `\\udfff` escapes and CESU-style UTF-8 bytes can carry, and which no tokenizer or response encoder
takes).
"""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from jserve.server.errors import APIError, bad_request

MAX_JSON_DEPTH = 32  # an OpenAI request needs about 6 (messages → content parts → part → ...)


async def read_json_object(request: Request, max_bytes: int) -> dict:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, not {media_type!r:.80}")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"the request body is {length} bytes, more than the limit of {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise APIError(413, f"the request body is more than the limit of {max_bytes} bytes")
    return await run_in_threadpool(parse_json_object, bytes(body))


def parse_json_object(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as err:
        raise bad_request(f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data: dict) -> None:
    """Depth and text of every key and value, walked with a stack: recursion is what a deep body attacks."""
    stack: list[tuple[dict | list, int]] = [(data, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        pairs = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in pairs:
            for text in (key, value):
                if isinstance(text, str):
                    _check_text(text)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        raise bad_request(
            f"the request body holds a lone surrogate (U+{code:04X}) in a string; text must be valid Unicode"
        ) from None
