"""The HTTP API's errors, all in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: a refused or
failed request (`RequestError`, whose gRPC status maps to an HTTP status), a body that fails validation (the
field named in `param`), and the framework's own refusals (404, 405, an unparsable body, the body-size 413)."""

from __future__ import annotations

import http
import json
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from server.request_state import RequestError

# gRPC status (the servers' shared vocabulary) -> HTTP status and OpenAI error type.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(exc: RequestError) -> dict[str, Any]:
    _, type_ = HTTP_STATUS.get(exc.code, (500, "server_error"))
    return error_body(exc.message, type_, exc.param, exc.code.name.lower())


class ErrorJSONResponse(JSONResponse):
    """An error body, ASCII-escaped: its message may quote the client's input, which may hold a lone surrogate
    that UTF-8 cannot encode (JSONResponse's ensure_ascii=False would then fail with a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(exc: RequestError) -> JSONResponse:
    return ErrorJSONResponse(error_json(exc), status_code=HTTP_STATUS.get(exc.code, (500, ""))[0])


def framework_error_response(exc: HTTPException) -> ErrorJSONResponse:
    """The framework's own refusals (unknown route, wrong method, an unparsable body, the body-size limit), in
    OpenAI's shape."""
    status = exc.status_code
    message = str(exc.detail)
    if status == 400:  # FastAPI's "There was an error parsing the body": say what was wrong with it
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):
            message = f"the body is not valid UTF-8: {cause.reason} at byte {cause.start}"
        elif isinstance(cause, RecursionError):
            message = "the body's JSON is nested too deeply"
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    code = http.HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    return ErrorJSONResponse(error_body(message, type_, None, code), status_code=status,
                             headers=getattr(exc, "headers", None))


def _common_prefix(locs: Sequence[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _field_loc(error: Any) -> tuple:
    return tuple(part for part in error.get("loc", ()) if part != "body")


def validation_error_response(errors: Sequence[Any]) -> ErrorJSONResponse:
    """A 400 for a body that fails validation, naming the first field at fault."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # loc is ("body", character position)
        param, message = None, f"the body is not valid JSON: {first.get('msg')} at character {first['loc'][-1]}"
    else:
        loc = _field_loc(first)
        # A value that fits no member of a union fails once per member, each with the member's name added to
        # `loc` (`prompt.str`, `prompt.list[int].0`): name the field they share, and say what each wanted.
        same = [e for e in errors if _field_loc(e)[:1] == loc[:1]]
        if len(same) > 1:
            loc = _common_prefix([_field_loc(e) for e in same])
        msgs = list(dict.fromkeys(e.get("msg", "invalid request") for e in same)) or ["invalid request"]
        param = ".".join(str(part) for part in loc) or None
        reason = msgs[0] if len(msgs) == 1 else "fits none of its allowed types: " + "; ".join(msgs)
        message = f"{param}: {reason}" if param else reason
    return ErrorJSONResponse(error_body(message, "invalid_request_error", param, first.get("type")), status_code=400)
