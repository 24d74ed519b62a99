"""OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``) for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("moeserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}

# Which OpenAI parameter a SamplingParams field name stands for.
PARAM_NAMES = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "n": "n",
    "logprobs": "logprobs",
    "stop": "stop",
    "min_tokens": "min_tokens",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "prompt_logprobs": "prompt_logprobs",
    "bad_words": "bad_words",
    "allowed_token_ids": "allowed_token_ids",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "truncation_side": "truncation_side",
    "priority": "priority",
}


class APIError(Exception):
    """An error for one request; the server keeps serving everyone else."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self) -> tuple:  # (a large body's error comes back from another process)
        return APIError, (self.status, self.message, self.param, self.code, self.type)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(e: ValueError, param_map: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine: its message starts with the field name."""
    message = str(e)
    first = message.split(" ", 1)[0]
    names = {**PARAM_NAMES, **(param_map or {})}
    param = names.get(first)
    if param and param != first:
        message = param + message[len(first) :]
    if param is None and message.startswith(("prompt", "a prompt")):
        param = (param_map or {}).get("prompt", "prompt")
    return bad_request(message, param)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(message, ERROR_TYPES.get(status, "invalid_request_error"), param, code), status_code=status, headers=headers
    )


def _describe_validation_error(err: dict) -> tuple[str, str | None]:
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        if "surrogate" in detail or "hex escape" in detail:
            detail += " (a lone UTF-16 surrogate escape such as \\ud800 is not text)"
        return f"invalid JSON body: {detail}".rstrip(": "), None
    # Union members show up in the location ("str", "list[int]"); keep only the field path.
    path = [
        p
        for p in loc
        if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool") and not p.startswith(("function-", "tagged-union"))
    ]
    param = ".".join(path) or None
    msg = err.get("msg", "invalid value")
    if param is None:
        return f"invalid request body: {msg}", None
    return f"{param}: {msg}", param


def describe_validation_errors(errors: list) -> tuple[str, str | None]:
    """(message, param) of a 400 for pydantic's errors of a request body."""
    message, param = _describe_validation_error(errors[0]) if errors else ("invalid request body", None)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, *describe_validation_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # A client may hang up while it uploads its body: a normal event, nobody to answer.
        log.debug("%s %s: the client disconnected during its upload", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
