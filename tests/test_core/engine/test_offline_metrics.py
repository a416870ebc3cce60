"""`LLM.get_metrics()` (vLLM's offline reader) names and labels what `/metrics` does (DESIGN.md's metrics): the
info gauges `cache_config_info{block_size,num_gpu_blocks}` and `lora_requests_info{max_lora,
running_lora_adapters,waiting_lora_adapters}` included."""
from __future__ import annotations

from core import LLM, SamplingParams
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
