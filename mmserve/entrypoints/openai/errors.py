"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    499: "client_closed_request",  # nginx's code: the client went away; no one reads the body
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status) or _phrase(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:  # not a registered status: never let the error path raise
        return "error"


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)
