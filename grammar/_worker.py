"""Grammar compile worker: a child process that builds outlines-core indexes.

Run as a script (`python grammar/_worker.py`), so it imports only the standard library
and outlines_core (no torch, no package __init__).  The parent can kill it at any time
(compile timeout); when the parent goes away its stdin closes and the worker exits.

Protocol on stdin/stdout: frames of an 8-byte little-endian length + a pickle.
  parent -> worker: ("init", eos_token_id, {token_bytes: [ids]}, vocab_size, [eos ids]), then
                    ("compile", regex) or ("cfg_init",) once, then ("cfg", gbnf_text) (xgrammar, grammar/cfg_compile.py)...
  worker -> parent: ("ready",) after init; ("ok", index_pickle, seconds) or ("err", message)
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any, BinaryIO

HEADER = 8


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(HEADER, "little") + data)
    stream.flush()


def read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = stream.read(n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: BinaryIO) -> Any:
    header = read_exact(stream, HEADER)
    if header is None:
        return None
    body = read_exact(stream, int.from_bytes(header, "little"))
    return None if body is None else pickle.loads(body)


EMPTY_LANGUAGE = "admits no string"


def reaches_final(index: Any) -> bool:
    """Breadth-first from the start state over the allowed tokens: is some final state reachable? (No:
    the regex, or the vocabulary, admits no string; a request would have nothing it may end with.) Stops at
    the first final state found: for a JSON grammar a few hundred states, not the whole index."""
    finals = set(index.get_final_states())
    if not finals:
        return False
    start = index.get_initial_state()
    seen, frontier = {start}, [start]
    while frontier:
        nxt_frontier = []
        for state in frontier:
            if state in finals:
                return True
            for token in index.get_allowed_tokens(state):
                nxt = index.get_next_state(state, token)
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return False


def main() -> int:
    import outlines_core

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the real stdout
    vocabulary = None
    token_map: dict = {}
    cfg_info = None
    init: tuple = ()
    while True:
        message = read_frame(stdin)
        if message is None:
            return 0
        if message[0] == "init":
            init = message
            eos_token_id, token_map = message[1], message[2]
            vocabulary = outlines_core.Vocabulary(eos_token_id, token_map)
            write_frame(stdout, ("ready",))
        elif message[0] == "compile":
            start = time.perf_counter()
            try:
                index = outlines_core.Index(message[1], vocabulary)
                if not reaches_final(index):
                    raise ValueError(f"the pattern {EMPTY_LANGUAGE} that this model's tokens can spell")
                blob = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
                write_frame(stdout, ("ok", blob, time.perf_counter() - start))
            except Exception as e:  # bad regex, vocabulary cannot match, size limits
                write_frame(stdout, ("err", f"{type(e).__name__}: {e}"[:2000]))
        elif message[0] == "cfg_init":  # importing xgrammar costs seconds: not counted in a compile's timeout
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from grammar.cfg_compile import compile_in_worker, tokenizer_info

            cfg_info = tokenizer_info(token_map, init[3], init[4])
            write_frame(stdout, ("ready",))
        elif message[0] == "cfg":
            start = time.perf_counter()
            try:
                blob = pickle.dumps(compile_in_worker(cfg_info, message[1]), protocol=pickle.HIGHEST_PROTOCOL)
                write_frame(stdout, ("ok", blob, time.perf_counter() - start))
            except Exception as e:  # noqa: BLE001 - a grammar xgrammar rejects
                write_frame(stdout, ("err", f"{type(e).__name__}: {e}"[:2000]))
        else:
            write_frame(stdout, ("err", f"unknown message {message[0]!r}"))


if __name__ == "__main__":
    try:
        os.nice(5)  # compiles must not starve the engine thread's process
    except OSError:
        pass
    sys.exit(main())
