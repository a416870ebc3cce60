"""Domain errors raised by the engine at admission; the gateway maps them to OpenAI-style 4xx."""
from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never be served as given (HTTP 400)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
