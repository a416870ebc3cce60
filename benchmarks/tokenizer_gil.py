"""Does a tokenizer call let other Python threads run? A thread encodes a long text while another sleeps 1 ms at a
time; the longest gap between the sleeper's wake-ups is how long the encode held the GIL in one piece.
`tokenizers.Tokenizer.encode` holds it for the whole call; transformers' fast-tokenizer `encode` (which the gateway
calls, on its tokenizer threads) goes through `encode_batch`, which releases it while Rust works.

    python benchmarks/tokenizer_gil.py [--chars 2000000]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = "def handler(request, *args):\n    return request.user.name + ' said: ' + str(args)  # ok\n"


def gil_hold(num_chars: int = 2_000_000) -> dict[str, Any]:
    """The longest gap of a thread that sleeps 1 ms at a time while another thread encodes a `num_chars` text:
    `tokenizers.Tokenizer.encode` against transformers' fast-tokenizer `encode` (what the gateway calls)."""
    from core.models.tokenizer_load import load_tokenizer

    tok = load_tokenizer(ROOT / "core" / "demo_model")
    text = (TEXT * (num_chars // len(TEXT) + 1))[:num_chars]
    out: dict[str, Any] = {"chars": num_chars}
    for name, fn in (("tokenizers.Tokenizer.encode", lambda: tok.backend_tokenizer.encode(text)),
                     ("transformers encode", lambda: tok.encode(text))):
        done, gaps = threading.Event(), []
        worker = threading.Thread(target=lambda: (fn(), done.set()))
        t0 = last = time.perf_counter()
        worker.start()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        worker.join()
        out[name] = {"encode_s": round(time.perf_counter() - t0, 2), "ticks": len(gaps),
                     "max_gap_ms": round(1000 * max(gaps), 1)}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chars", type=int, default=2_000_000)
    print(json.dumps(gil_hold(ap.parse_args().chars), indent=2))
