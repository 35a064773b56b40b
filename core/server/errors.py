"""Errors in the OpenAI schema: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server returns has this shape, with a one-line ``message`` that starts with the
field it is about (``max_tokens: must be >= 0, got -1``), as the CLI's messages do.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from fastapi.responses import JSONResponse

from ..config import describe
from ..errors import RequestError, did_you_mean

#: The ``type`` of an error, by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error response: HTTP ``status`` and the fields of the OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# -- request validation errors (pydantic) -> one 400 ---------------------------------------------


def _path(loc: Sequence[Any]) -> str:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _problem(error: dict, field_names: Iterable[str]) -> tuple[str, Optional[str]]:
    """``(problem, code)`` of one pydantic error, worded like the CLI's config errors."""
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    expected = {"int_type": "int", "int_parsing": "int", "int_from_float": "int", "float_type": "float",
                "float_parsing": "float", "bool_type": "bool", "bool_parsing": "bool", "string_type": "str",
                "list_type": "list", "dict_type": "an object", "model_type": "an object",
                "model_attributes_type": "an object"}
    if kind in expected:
        return f"expected {expected[kind]}, got {describe(value)}", "invalid_type"
    bounds = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
              "less_than": ("lt", "<")}
    if kind in bounds:
        key, sign = bounds[kind]
        return f"must be {sign} {ctx.get(key)}, got {value}", "invalid_value"
    if kind == "extra_forbidden":
        name = str(error["loc"][-1])
        return f"unknown field{did_you_mean(name, field_names) or ' (not supported by this server)'}", "unknown_field"
    if kind == "missing":
        return "required field is missing", "missing_field"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"])), "invalid_value"
    if kind == "too_short":
        return f"must not be empty, got {describe(value)}", "invalid_value"
    return error["msg"], "invalid_value"


def validation_error(errors: Sequence[dict], field_names: Iterable[str]) -> APIError:
    """The first of FastAPI's request validation errors, as an :class:`APIError` 400."""
    if not errors:
        return APIError(400, "invalid request")
    error = errors[0]
    if error["type"] == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", error["msg"])
        return APIError(400, f"invalid JSON: {detail}", code="json_invalid")
    param = _path(error["loc"])
    problem, code = _problem(error, list(field_names))
    if error["type"] == "missing" and not param:
        return APIError(400, "the request body must be a JSON object", code="invalid_type")
    if not param:
        if isinstance(error.get("input"), (bytes, str)):  # not parsed as JSON at all
            return APIError(400, "the request body must be JSON: send it with 'Content-Type: application/json'",
                            code="invalid_type")
        return APIError(400, f"the request body: {problem}", code=code)
    return APIError(400, f"{param}: {problem}", param=param, code=code)


def as_400(build):
    """``build()``, with a :class:`~specdec.errors.RequestError` (a bad field the server's own
    parsing found: tools, response_format, ...) as its 400 naming the field."""
    try:
        return build()
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
