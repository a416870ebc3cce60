"""Domain exceptions of the adapters package.

`AdapterError` carries an HTTP status and a machine-readable code so the gateway can
turn it into `{"error": {"message", "type", "param", "code"}}` without guessing.
"""

from __future__ import annotations

import re


class AdapterError(Exception):
    """An adapter that cannot be loaded or served (bad files, bad config, wrong base)."""

    def __init__(self, message: str, code: str = "invalid_adapter", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def __repr__(self) -> str:
        return f"AdapterError({self.message!r}, code={self.code!r}, status={self.status})"

    def fresh(self) -> "AdapterError":
        """A new exception with the same message, code and status: a remembered error raised again for many
        requests must not grow one shared traceback (which keeps every raising frame alive)."""
        return AdapterError(self.message, code=self.code, status=self.status)


_NOT_SHOWN = re.compile(r"[^\x20-\x7e]|[/\\]")   # all but printable ASCII, and the path separators
MAX_SHOWN_CHARS = 160


def shown(name: str) -> str:
    """A name read from an adapter's files (a weight's key, a module path) as an error message may show it: the
    message reaches the tenant who named the adapter, and the file's author chose the name. Printable ASCII
    without '/' and '\\' (any other character becomes '?': no filesystem path, no control character), at most
    MAX_SHOWN_CHARS (the head elided: the tail names the layer and module)."""
    text = _NOT_SHOWN.sub("?", name)
    return text if len(text) <= MAX_SHOWN_CHARS else "..." + text[-(MAX_SHOWN_CHARS - 3):]


class AdapterNotFoundError(AdapterError):
    """The adapter path or hub id does not exist (HTTP 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="adapter_not_found", status=404)


class SlotPoolError(RuntimeError):
    """Misuse of the device slot pool (no free slot, unloading a pinned slot, ...)."""


class SlotPoolFullError(SlotPoolError):
    """Every slot is pinned by the current step: nothing can be evicted."""


class SlotPoolIntegrityError(SlotPoolError):
    """`LoRASlotPool.check_integrity()` found an inconsistent state (a bug, not user error)."""


class LoRAContextError(RuntimeError):
    """A LoRA-wrapped linear saw a batch that does not match the step's LoRA metadata."""


# Codes used in AdapterError.code (status 400 unless noted).
CODE_NOT_FOUND = "adapter_not_found"  # 404
CODE_INVALID = "invalid_adapter"
CODE_RANK_TOO_LARGE = "lora_rank_too_large"
CODE_UNSUPPORTED_TARGET = "unsupported_target_modules"
CODE_UNSUPPORTED_FEATURE = "unsupported_adapter_feature"
CODE_SHAPE_MISMATCH = "adapter_shape_mismatch"
CODE_CORRUPT = "corrupt_adapter_weights"
