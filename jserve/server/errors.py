"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

import json

from starlette.responses import Response

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def to_dict(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII escapes: a message quoting the client's input must encode whatever that input held
        return Response(json.dumps(self.to_dict()), status_code=self.status, media_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
