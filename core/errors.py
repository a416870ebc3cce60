"""Domain errors raised by the engine at admission; the gateway maps them to OpenAI-style 4xx."""
from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never be served as given (HTTP 400)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class RequestFault(RuntimeError):
    """One request failed inside the engine step; the other requests of the batch go on. `status` is 400 when
    the request's own input was at fault (an id outside the vocabulary, a grammar with no way on), 500 otherwise
    (an internal failure that touched only this request)."""

    def __init__(self, message: str, status: int = 500, code: str = "request_failed",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param


class UnknownAdapter(KeyError, ValueError):
    """A LoRA adapter name that names no loaded adapter (nor a servable `--lora-dir` entry): a `KeyError` (a failed
    lookup) and a `ValueError` (a bad argument to `LLM.generate`, as vLLM raises for one), with a plain message."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no LoRA adapter named {name!r} is loaded")
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type, tuple[str]]:   # pickled (to or from a worker process) as it was made
        return UnknownAdapter, (self.name,)
