"""Where the gateway's work proportional to a prompt runs: tokenization, chat-template rendering and
detokenization, off the event loop.

A small dedicated thread pool (not asyncio's default executor, so a burst of big prompts never delays the other
`to_thread` users). Threads are enough because the slow part releases the GIL: transformers' fast tokenizer
encodes through `tokenizers.Tokenizer.encode_batch`, which lets go of the GIL for the whole Rust call (measured:
the loop ticked every 1 ms throughout a 4 MB encode), while `Tokenizer.encode` holds it to the end (one 4.6 s
gap). Rendering a template and checking ids are Python code that hands the GIL over every switch interval.

Memory: tokenizing a big text leaves its freed working memory in the worker's glibc arena, which RSS keeps
(measured: 6 MB of text, +500 MB for good). `trim_memory_soon()` hands it back (`malloc_trim(0)` covers every
arena: -480 MB in 57 ms). Not after merely reading a big body: there a trim stalled the event loop (the loop
thread's arena is locked while it is trimmed; /health p99 80 -> 194 ms) for a few MB of RSS.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

log = logging.getLogger("loraplex.gateway")

T = TypeVar("T")
NUM_WORKERS = 2                  # each worker may get its own glibc arena: a few, not one per core
TRIM_AFTER_CHARS = 1 << 20       # a text this long, once tokenized, asks for a trim

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_trim_pending = threading.Event()


def executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="loraplex-tokenize")
        return _executor


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a tokenizer worker thread; its exception is raised here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor(), functools.partial(fn, *args, **kwargs))


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")   # CDLL: the GIL is released during the call
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None   # not glibc (musl, macOS): nothing to do
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _trim() -> None:
    _trim_pending.clear()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def trim_memory_soon() -> None:
    """Returns freed heap memory to the OS, on a worker thread (at most one trim queued at a time)."""
    if _trim_pending.is_set():
        return
    _trim_pending.set()
    try:
        executor().submit(_trim)
    except RuntimeError:   # the pool is shut down (interpreter exit)
        _trim_pending.clear()
