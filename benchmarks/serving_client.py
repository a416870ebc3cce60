"""The client side of benchmarks/serving.py: Poisson arrivals, streamed requests stamped per token, the statistics.

Every request asks for `stream_options.continuous_usage_stats`: each chunk carries `usage.completion_tokens`, the
running count of its tokens, so a chunk is stamped when it brings tokens, whatever text they decode to (a chunk
with text but no new token is not a token's arrival; a token whose text is held back still is). TTFT is the
first token-bearing chunk after the request was sent, ITL the gap between consecutive token-bearing chunks,
end-to-end the time to the last byte, TPOT (vLLM's "time per output token") (end-to-end - TTFT) / (tokens - 1).

The run FAILS (`TokenCountError`) when a chunk of a successful stream carries no token count, when the counts
do not add up to the final usage, when a request streamed no token-bearing chunk, or when more than
`MAX_EMPTY_TEXT_SHARE` of the token-bearing chunks carry no text (a tokenizer that decodes most ids to nothing:
what users see would not be what is measured).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

import httpx

MAX_EMPTY_TEXT_SHARE = 0.05


def launch_server(cmd: list[str], port: int, log_name: str, startup_timeout_s: float,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts `cmd` (a `loraplex serve` on `port`) with its output in an unnamed temp file (gone with the last of
    its handles: nothing is left in the temp folder, even by a killed run), and waits until /health answers 200;
    raises, with the end of that output, when it exits first or does not answer within the timeout."""
    log = tempfile.TemporaryFile("w+", prefix=f"{log_name}_{port}_", suffix=".log")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + startup_timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                log.close()    # the server keeps writing to its own handle
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start in {startup_timeout_s} s:\n{_tail(log)}")


def _tail(log: IO[str], chars: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


class TokenCountError(RuntimeError):
    """The stream does not say how many tokens each chunk carries: the latencies would be wrong."""


@dataclass(frozen=True)
class SLO:
    """vLLM's goodput: a request counts when its TTFT and its mean time per output token are both within bounds."""

    ttft_s: float = 0.5
    tpot_s: float = 0.05


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, delay: float) -> dict[str, Any]:
    """One streamed request sent after `delay` seconds: its token stamps, counts and errors."""
    await asyncio.sleep(delay)
    start = time.perf_counter()
    stamps: list[tuple[float, int]] = []        # (arrival, tokens the chunk brought)
    count, final, empty_text, prompt_tokens = 0, None, 0, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}", "start": start}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": f"in-band error: {chunk['error'].get('message')}", "start": start}
                if not chunk.get("choices"):                  # the final usage chunk
                    final = (chunk.get("usage") or {}).get("completion_tokens")
                    continue
                usage = chunk.get("usage")
                if usage is not None:
                    prompt_tokens = usage.get("prompt_tokens")
                if usage is None or "completion_tokens" not in usage:
                    raise TokenCountError("a streamed chunk carries no token count (stream_options."
                                          "continuous_usage_stats is not honoured): TTFT/ITL cannot be stamped")
                new = usage["completion_tokens"] - count
                if new > 0:
                    stamps.append((time.perf_counter(), new))
                    count = usage["completion_tokens"]
                    empty_text += not _chunk_text(chunk["choices"][0])
    except httpx.HTTPError as exc:
        return {"error": repr(exc), "start": start}
    end = time.perf_counter()
    if not stamps:
        raise TokenCountError(f"a request streamed no chunk that carried a token (final usage {final})")
    if final is not None and final != count:
        raise TokenCountError(f"the chunks' token counts reach {count}, the final usage says {final}")
    ttft = stamps[0][0] - start
    return {"error": None, "start": start, "end": end, "ttft": ttft, "e2e": end - start, "tokens": count,
            "itl": [b[0] - a[0] for a, b in zip(stamps, stamps[1:])], "num_chunks": len(stamps),
            "empty_text_chunks": empty_text, "prompt_tokens": prompt_tokens,
            "tpot": (end - start - ttft) / (count - 1) if count > 1 else None}


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank); NaN for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ttft_by_prompt_quarter(ok: list[dict[str, Any]]) -> list[float]:
    """TTFT p50 of the requests in each quarter of the prompt lengths, shortest first (empty when the server does not
    report prompt tokens): under least-remaining-first ordering, which prompts wait."""
    sized = sorted((r["prompt_tokens"], r["ttft"]) for r in ok if r["prompt_tokens"] is not None)
    if len(sized) < 4:
        return []
    quarters = [sized[len(sized) * k // 4:len(sized) * (k + 1) // 4] for k in range(4)]
    return [pct([t for _, t in q], 0.5) for q in quarters]


def itl_tail_interval(ok: list[dict[str, Any]], num_resamples: int = 400, seed: int = 0) -> list[float]:
    """A 90% bootstrap interval of ITL p99 / p50, resampling requests (a request's gaps move together: they share
    its steps); empty for fewer than 4 requests with gaps."""
    gaps = [r["itl"] for r in ok if r["itl"]]
    if len(gaps) < 4:
        return []
    rng = random.Random(seed)
    ratios = []
    for _ in range(num_resamples):
        pooled = [x for g in rng.choices(gaps, k=len(gaps)) for x in g]
        ratios.append(pct(pooled, 0.99) / pct(pooled, 0.5))
    ratios.sort()
    return [ratios[int(0.05 * num_resamples)], ratios[int(0.95 * num_resamples) - 1]]


def median_ratio_interval(a: list[float], b: list[float], num_resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 90% bootstrap interval of median(a) / median(b), each resampled on its own; empty if either is empty."""
    if not a or not b:
        return []
    rng = random.Random(seed)
    ratios = sorted(pct(rng.choices(a, k=len(a)), 0.5) / pct(rng.choices(b, k=len(b)), 0.5)
                    for _ in range(num_resamples))
    return [ratios[int(0.05 * num_resamples)], ratios[int(0.95 * num_resamples) - 1]]


def summarize(results: list[dict[str, Any]], rate: float, slo: SLO) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None]
    span = max(r["end"] for r in ok) - min(r["start"] for r in results) if ok else float("nan")
    num_chunks = sum(r["num_chunks"] for r in ok)
    empty = sum(r["empty_text_chunks"] for r in ok)
    if num_chunks and empty > MAX_EMPTY_TEXT_SHARE * num_chunks:
        raise TokenCountError(f"{empty} of {num_chunks} token-bearing chunks carry no text: the tokenizer decodes "
                              "most sampled ids to nothing (use a tokenizer as large as the model's vocabulary)")
    out: dict[str, Any] = {"rate": rate, "num_requests": len(results), "num_errors": len(results) - len(ok),
                           "errors": sorted({r["error"] for r in results if r["error"]})[:3]}
    for key, values in (("ttft", [r["ttft"] for r in ok]), ("itl", [x for r in ok for x in r["itl"]]),
                        ("e2e", [r["e2e"] for r in ok]), ("tpot", [r["tpot"] for r in ok if r["tpot"] is not None])):
        for q in (50, 90, 99):
            out[f"{key}_p{q}_s"] = pct(values, q / 100)
    good = [r for r in ok if r["ttft"] <= slo.ttft_s and (r["tpot"] is None or r["tpot"] <= slo.tpot_s)]
    num_out = sum(r["tokens"] for r in ok)
    prompts = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    nan = float("nan")
    out.update({"output_tok_s": num_out / span, "request_s": len(ok) / span, "goodput_request_s": len(good) / span,
                "goodput_share": len(good) / len(results) if results else nan,
                "mean_ttft_s": statistics.fmean(r["ttft"] for r in ok) if ok else nan,
                "output_tokens": num_out, "duration_s": span,
                "prompt_tokens_mean": statistics.fmean(prompts) if prompts else nan,
                "ttft_p50_by_prompt_quarter_s": ttft_by_prompt_quarter(ok),
                "ttft_values_s": [round(r["ttft"], 5) for r in ok],      # per request: intervals of TTFT ratios
                "itl_tail_ratio_ci90": itl_tail_interval(ok),
                "tokens_per_chunk": num_out / num_chunks if num_chunks else nan,
                "empty_text_chunk_share": empty / num_chunks if num_chunks else nan})
    return out


CLIENT_KEEPALIVE_S = 2.0   # under uvicorn's `timeout_keep_alive` (5 s), so the client always closes first


async def run_rate(url: str, reqs: list[dict], rate: float, seed: int, slo: SLO,
                   transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """All of `reqs` with Poisson arrivals at `rate` per second (inf: all at once); `transport`: tests."""
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in reqs:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    # an idle connection is dropped here before the server's keep-alive timeout (uvicorn: 5 s) can close it: at
    # httpx's default expiry, also 5 s, a request sent on a connection the server was closing failed with
    # ReadError('') (latency_slo.py, 50% load, once)
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs),
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, transport=transport) as client:
        results = await asyncio.gather(*(stream_one(client, url, b, d) for b, d in zip(reqs, delays)))
    return summarize(list(results), rate, slo)
