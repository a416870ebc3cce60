"""A stack sampler for the server under benchmarks/serving_overhead.py (`--profile`): where its threads are.

Started in the server process before `gateway.cli.console_main` (see `server_command`), a daemon thread reads
`sys._current_frames()` every `INTERVAL_S` and counts, per thread name, the innermost frame that is in this
repo, or in a few named libraries (asyncio's selector wait = the event loop idle, uvicorn, starlette, torch,
zmq, msgspec). Every second it rewrites `$LORAPLEX_SAMPLER_OUT` (JSON: thread -> {place: samples}). The sampler
needs the GIL to take a sample, so threads that hold it are over-counted; read shares, not absolute times.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

INTERVAL_S = 0.002
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBS = ("selectors.py", "uvicorn", "starlette", "h11", "torch", "zmq", "msgspec", "json", "tokenizers",
        "transformers", "threading.py", "queue.py", "asyncio")


def _place(frame) -> str:   # noqa: ANN001
    f = frame
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(ROOT):
            return f"{os.path.relpath(path, ROOT)}:{f.f_code.co_name}"
        for lib in LIBS:
            if lib in path:
                inner = frame.f_code.co_name
                return f"[{lib}] {inner}"
        f = f.f_back
    return f"[other] {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"


def start(out_path: str) -> None:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def run() -> None:
        me = threading.get_ident()
        last = time.monotonic()
        while True:
            time.sleep(INTERVAL_S)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    counts[names.get(ident, str(ident))][_place(frame)] += 1
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                data = {t: dict(c.most_common(25)) for t, c in counts.items()}
                with open(out_path + ".tmp", "w") as fh:
                    json.dump(data, fh, indent=1)
                os.replace(out_path + ".tmp", out_path)

    threading.Thread(target=run, name="sampler", daemon=True).start()


if __name__ == "__main__":   # python serving_overhead_sampler.py OUT -- server args...
    out = sys.argv[1]
    sys.argv = ["loraplex", *sys.argv[3:]]
    start(out)
    from gateway.cli import console_main

    console_main()
