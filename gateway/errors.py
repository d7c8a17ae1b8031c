"""`GatewayError`: every failure the gateway reports. `body()` is OpenAI's envelope
`{"error": {message, type, param, code}}`; a dialect with another envelope gives its own
(`dialect.Dialect.error_body`), and the app answers each route's errors in its dialect's."""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """A request the gateway answers with an error status; never a 500 for client mistakes."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(exc: Exception) -> GatewayError:
    """The 500 an unexpected exception is answered with (its traceback goes to the log, not here)."""
    return GatewayError(f"internal gateway error: {type(exc).__name__}: {exc}", 500)
