"""The API's errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """An answer other than 200, raised anywhere a request is handled; the app's middleware sends it."""

    def __init__(
        self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, code, param)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param)
