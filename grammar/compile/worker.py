"""Grammar compile worker: a child process that lowers schemas to regexes and builds outlines-core indexes.

Run as a script (`python grammar/compile/worker.py [MEMORY_LIMIT_BYTES]`), so it imports only the standard library,
outlines_core and the torch-free grammar modules it needs (no torch, no package __init__).  The parent can kill
it at any time (compile timeout); when the parent goes away its stdin closes and the worker exits.  With a
memory limit it caps its own private writable memory (RLIMIT_DATA) before anything else: a schema, regex or
grammar whose expansion passes the limit fails here (MemoryError -> ("memory",), or the process dies), never in
the parent.

Protocol on stdin/stdout: frames of an 8-byte little-endian length + a pickle.
  parent -> worker: ("init", eos_token_id, {token_bytes: [ids]}, vocab_size, [eos ids]), then
                    ("compile", regex) | ("lower_init",) once, then ("recipe", recipe) / ("check", recipe)
                    (grammar/compile/lowering.py: lower, then compile / lower only) | ("cfg_init",) once, then
                    ("cfg", gbnf_text) (xgrammar, grammar/cfg/worker_side.py)...
  worker -> parent: ("ready",) after init; ("ok", index_pickle | None, seconds), ("err", message),
                    ("grammar_error", message, code, param, pointer) (a schema lowering's 400), ("memory",)
"""

from __future__ import annotations

import os
import pickle
import resource
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


def reaches_final(index: Any, skip: "frozenset[int]" = frozenset(), end: int | None = None) -> bool:
    """Breadth-first from the start state over the allowed tokens but `skip`: is some final state reachable? (No:
    the regex, or the vocabulary, admits no string; a request would have nothing it may end with.) With `end` (the
    end slot's fake token, grammar/compile/lowering.py) a state counts as final where `end` leads to a final state,
    as CompiledGrammar.is_final reads it, and `end` is never walked (it stands for EOS, and its byte could spell a
    U+0004 of the regex); `skip`: the real tokens CompiledGrammar bans (those writing the end slot's character).
    Stops at the first final state found: for a JSON grammar a few hundred states, not the whole index."""
    finals = set(index.get_final_states())
    if not finals:
        return False

    def is_final(state: int) -> bool:
        if end is None:
            return state in finals
        nxt = index.get_next_state(state, end)
        return nxt is not None and nxt in finals

    skip = skip | {end} if end is not None else skip
    start = index.get_initial_state()
    seen, frontier = {start}, [start]
    while frontier:
        nxt_frontier = []
        for state in frontier:
            if is_final(state):
                return True
            for token in index.get_allowed_tokens(state):
                if token in skip:
                    continue
                nxt = index.get_next_state(state, token)
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return False


def end_slot_tokens(token_map: dict, vocab_size: int) -> "tuple[frozenset[int], int | None]":
    """(the real tokens whose bytes hold the end slot's character, banned in every CompiledGrammar; the end slot's
    fake token): grammar/compile/lowering.py END_CHAR, grammar/compile/pool.py. Real ids lie below `vocab_size`,
    the fake ones above."""
    banned = frozenset(i for data, ids in token_map.items() if b"\x04" in data for i in ids if i < vocab_size)
    fakes = [i for i in token_map.get(b"\x04", ()) if i >= vocab_size]
    return banned, (fakes[0] if fakes else None)


def build_index(outlines_core: Any, regex: str, vocabulary: Any, skip: "frozenset[int]" = frozenset(),
                end: int | None = None) -> bytes:
    index = outlines_core.Index(regex, vocabulary)
    if not reaches_final(index, skip, end):
        raise ValueError(f"the pattern {EMPTY_LANGUAGE} that this model's tokens can spell")
    return pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)


def limit_memory(argv: list[str]) -> None:
    """The memory limit from the command line (bytes; 0 or absent: none), set before the first import.

    RLIMIT_DATA (Linux >= 4.7 counts every private writable mapping: the heap, anonymous mmaps, thread stacks)
    bounds what the worker can allocate, the Rust index and Python's strings alike; unlike RLIMIT_AS it does not
    count the libraries' mapped code, which with a CUDA build of torch (imported by xgrammar) is gigabytes of
    address space that no compile allocates. Where RLIMIT_DATA is missing, RLIMIT_AS."""
    limit = int(argv[1]) if len(argv) > 1 else 0
    if limit > 0:
        which = getattr(resource, "RLIMIT_DATA", resource.RLIMIT_AS)
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)   # a stricter limit from the environment stays
        resource.setrlimit(which, (limit, limit))


def main() -> int:
    import outlines_core  # a script: after limit_memory, so the limit counts it

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the real stdout
    # the grammar modules (torch-free: lowering, cfg_compile) and the recipes the parent pickles
    # (run as a script: sys.path[0] is this folder, whose module names must not shadow anything; the repo root
    # makes `grammar.*` importable without importing torch)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(here)))
    vocabulary = None
    banned: "frozenset[int]" = frozenset()
    end: int | None = None
    token_map: dict = {}
    cfg_info = None
    init: tuple = ()
    while True:
        try:
            message = read_frame(stdin)
        except MemoryError:
            write_frame(stdout, ("memory",))
            return 1
        if message is None:
            return 0
        start = time.perf_counter()
        try:
            if message[0] == "init":
                init = message
                eos_token_id, token_map = message[1], message[2]
                vocabulary = outlines_core.Vocabulary(eos_token_id, token_map)
                banned, end = end_slot_tokens(token_map, message[3])
                write_frame(stdout, ("ready",))
            elif message[0] == "compile":
                try:
                    blob = build_index(outlines_core, message[1], vocabulary, banned, end)
                    write_frame(stdout, ("ok", blob, time.perf_counter() - start))
                except MemoryError:
                    raise
                except Exception as e:  # bad regex, vocabulary cannot match, size limits
                    write_frame(stdout, ("err", f"{type(e).__name__}: {e}"[:2000]))
            elif message[0] == "lower_init":  # jsonschema's import costs seconds: not in a compile's timeout
                from grammar.compile.lowering import warm_lowering  # a script: grammar.* once main() set sys.path

                warm_lowering()
                write_frame(stdout, ("ready",))
            elif message[0] in ("recipe", "check"):
                from grammar.errors import GrammarError  # a script: grammar.* once main() set sys.path
                from grammar.compile.lowering import index_regex  # a script: grammar.* once main() set sys.path

                try:
                    regex = message[1].lower()
                    blob = None if message[0] == "check" else build_index(outlines_core, index_regex(regex),
                                                                          vocabulary, banned, end)
                    write_frame(stdout, ("ok", blob, time.perf_counter() - start))
                except GrammarError as e:   # the schema's 400, as admission raised it before
                    write_frame(stdout, ("grammar_error", e.message, e.code, e.param, e.pointer))
                except MemoryError:
                    raise
                except Exception as e:  # noqa: BLE001 - a regex outlines-core cannot build
                    write_frame(stdout, ("err", f"{type(e).__name__}: {e}"[:2000]))
            elif message[0] == "cfg_init":  # importing xgrammar costs seconds: not counted in a compile's timeout
                # a script: grammar.* once main() set sys.path
                from grammar.cfg.worker_side import compile_in_worker, tokenizer_info

                cfg_info = tokenizer_info(token_map, init[3], init[4])
                write_frame(stdout, ("ready",))
            elif message[0] == "cfg":
                try:
                    blob = pickle.dumps(compile_in_worker(cfg_info, message[1]), protocol=pickle.HIGHEST_PROTOCOL)
                    write_frame(stdout, ("ok", blob, time.perf_counter() - start))
                except MemoryError:
                    raise
                except Exception as e:  # noqa: BLE001 - a grammar xgrammar rejects
                    write_frame(stdout, ("err", f"{type(e).__name__}: {e}"[:2000]))
            else:
                write_frame(stdout, ("err", f"unknown message {message[0]!r}"))
        except MemoryError:   # past the memory limit: report it; the parent restarts this process
            write_frame(stdout, ("memory",))
            return 1


if __name__ == "__main__":
    limit_memory(sys.argv)
    try:
        os.nice(5)  # compiles must not starve the engine thread's process
    except OSError:
        pass
    sys.exit(main())
