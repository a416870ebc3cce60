"""Admission errors of the grammar package (the gateway turns them into HTTP 400)."""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal[
    "unsupported_json_schema",
    "invalid_json_schema",
    "invalid_response_format",
    "grammar_compile_timeout",
    "invalid_regex",
    "invalid_grammar",
    "invalid_structured_outputs",
    "invalid_tools",
]

SCHEMA_PARAM = "response_format.json_schema.schema"


class GrammarError(ValueError):
    """A response_format / schema the engine cannot serve faithfully.

    `code` is one of ErrorCode, `param` names the request field (OpenAI error shape),
    `pointer` the JSON pointer inside the schema when the error is about one keyword.
    """

    def __init__(
        self,
        message: str,
        code: ErrorCode = "unsupported_json_schema",
        param: str | None = SCHEMA_PARAM,
        pointer: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.pointer = pointer

    def to_dict(self) -> dict[str, str | None]:
        """The OpenAI `error` object body."""
        return {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }

    def __repr__(self) -> str:
        return f"GrammarError(code={self.code!r}, param={self.param!r}, message={self.message!r})"


def unsupported(keyword: str, pointer: str, detail: str = "") -> GrammarError:
    """The standard 'keyword at pointer is not supported' error."""
    msg = f"unsupported JSON schema keyword '{keyword}' at '{pointer_str(pointer)}'"
    if detail:
        msg += f": {detail}"
    return GrammarError(msg, "unsupported_json_schema", SCHEMA_PARAM, pointer_str(pointer))


def pointer_str(pointer: str) -> str:
    """Render a JSON pointer as a URI fragment ('#', '#/properties/a')."""
    return pointer if pointer.startswith("#") else "#" + pointer


def escape_pointer_token(token: str | int) -> str:
    """RFC 6901 escaping of one reference token."""
    return str(token).replace("~", "~0").replace("/", "~1")
