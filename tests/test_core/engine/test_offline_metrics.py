"""`LLM.get_metrics()` (vLLM's offline reader) names and labels what `/metrics` does (DESIGN.md's metrics): the
info gauges `cache_config_info{block_size,num_gpu_blocks}` and `lora_requests_info{max_lora,
running_lora_adapters,waiting_lora_adapters}` included; the TTFT / inter-token / end-to-end latency histograms and
`request_success` by finish reason, as vLLM's reader returns them; the prefix-cache query and hit counters count
each admitted request's lookup once."""
from __future__ import annotations

from core import LLM, SamplingParams
from core.engine.stats import Histogram
from lora_fixtures import adapter_dir
from testlib import encode, model_dir

MODEL = "llama_gqa"


def _by_name(llm: LLM) -> dict[str, object]:
    return {m.name: m for m in llm.get_metrics()}


def test_get_metrics_has_the_info_gauges() -> None:
    path = model_dir(MODEL)
    with LLM(str(path), dtype="float32", device="cpu", warmup=False, num_kv_blocks=64, max_loras=3,
             lora_modules={"tenant-a": str(adapter_dir(MODEL, "qv_r4"))}) as llm:
        metrics = _by_name(llm)
        cache = metrics["loraplex:cache_config_info"]
        assert cache.labels == {"block_size": "16", "num_gpu_blocks": "64"} and cache.value == 1.0
        idle = metrics["loraplex:lora_requests_info"]
        assert idle.labels == {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert idle.value > 0   # the time it was read, as vLLM's
        engine = llm.engine
        engine.add_request("r", encode(path, "def add(a, b):"), SamplingParams(max_tokens=8, temperature=0.0),
                           lora=engine.resolve_lora("tenant-a"))
        assert _by_name(llm)["loraplex:lora_requests_info"].labels["waiting_lora_adapters"] == "tenant-a"
        seen = set()
        while engine.has_unfinished_requests():
            engine.step()
            seen.add(_by_name(llm)["loraplex:lora_requests_info"].labels["running_lora_adapters"])
        assert "tenant-a" in seen
        assert _by_name(llm)["loraplex:lora_requests_info"].labels["running_lora_adapters"] == ""


def test_get_metrics_has_the_latency_histograms_and_finished_requests() -> None:
    """The finding: `get_metrics()` had no histogram at all (vLLM's has `time_to_first_token_seconds`,
    `inter_token_latency_seconds`, `e2e_request_latency_seconds` as `Histogram`s) nor `request_success`."""
    with LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", warmup=False, num_kv_blocks=64) as llm:
        outs = llm.generate(["def f(x):", "import os", "x = 1"],
                            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert [o.finish_reason for o in outs] == ["length"] * 3
        metrics = llm.get_metrics()
    hists = {m.name: m for m in metrics if isinstance(m, Histogram)}
    counts = {"loraplex:time_to_first_token_seconds": 3, "loraplex:inter_token_latency_seconds": 3 * 4,
              "loraplex:e2e_request_latency_seconds": 3}
    assert {name: h.count for name, h in hists.items()} == counts
    for h in hists.values():
        bounds = list(h.buckets)
        assert bounds[-1] == "+Inf" and h.buckets["+Inf"] == h.count and h.sum > 0
        values = [h.buckets[b] for b in bounds]
        assert values == sorted(values)                     # cumulative, as Prometheus' `le` buckets
        assert [float(b) for b in bounds[:-1]] == sorted(float(b) for b in bounds[:-1])
    success = [m for m in metrics if m.name == "loraplex:request_success"]
    assert [(m.labels, m.value) for m in success] == [({"finished_reason": "length"}, 3)]


def test_prefix_cache_counts_each_admitted_lookup_once() -> None:
    """Four identical prompts of 3+ blocks at once: the first computes the shared prefix, the others (held back a
    step so it is computed once) then find it. Each admission is one query of its prompt's tokens; the finding:
    the others' first, given-back lookup counted too (queries 7 prompts' worth, hit rate 3/7 instead of 3/4)."""
    path = model_dir(MODEL)
    ids = encode(path, "def add(a, b):\n    return a + b\n" * 6)
    assert len(ids) > 3 * 16
    with LLM(str(path), dtype="float32", device="cpu", warmup=False, num_kv_blocks=64, block_size=16) as llm:
        llm.generate([ids] * 4, SamplingParams(max_tokens=2, temperature=0.0))
        metrics = _by_name(llm)
    cached = (len(ids) - 1) // 16 * 16                      # never the last prompt token
    assert metrics["loraplex:prefix_cache_queries"].value == 4 * len(ids)
    assert metrics["loraplex:prefix_cache_hits"].value == 3 * cached
