"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status the official clients turn into their exception classes (400 BadRequestError,
401 AuthenticationError, 404 NotFoundError, 429 RateLimitError, 5xx InternalServerError).

A GenerateError carries the gRPC status the error table in docs/grpc-api.md ("Errors") gives; this is the one
place that says which HTTP status each becomes.
"""

from __future__ import annotations

from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from model_service.api.generation import GenerateError

# OpenAI's type names where it has them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_generate_error(error: GenerateError) -> ApiError:
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Queue or stream limit: retry; a request larger than the pool: never.
        status = 429 if error.retry_later else 400
    else:
        status = HTTP_STATUS.get(error.code, 500)
    return ApiError(status, error.message, code=error.code.name.lower())


def from_validation_error(error: RequestValidationError) -> ApiError:
    """The first problem pydantic found in the body, named by its path (messages.0.role)."""
    problems = error.errors()
    if not problems:
        return ApiError(400, "the request body is not valid")
    first = problems[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        message = f"{param} is not a field this server knows; check its spelling (unknown fields are refused, not ignored)"
    elif first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('msg')}"
        param = None
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return ApiError(400, message + more, param=param, code="invalid_value")


def install_handlers(app) -> None:
    """Every error the app can answer, in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error.response()

    @app.exception_handler(GenerateError)
    async def generate_error(request, error: GenerateError):
        return from_generate_error(error).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        return from_validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions, /v1/completions"
        response = ApiError(error.status_code, message).response()
        for name, value in (error.headers or {}).items():
            response.headers[name] = value
        return response
