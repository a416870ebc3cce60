"""Speculative decoding through a real `loraplex serve --speculative-config ...`: greedy completions of the
base and of an adapter, concurrently and streamed, equal PEFT; a JSON schema still validates; the draft and
accepted counters are in /metrics; a bad config stops the start-up naming the field."""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from testlib import model_dir  # noqa: E402
from gateway_server import ServerProcess, loraplex_command, metric_value  # noqa: E402
from lora_fixtures import adapter_dir, norm_text  # noqa: E402
from served_lora_cases import MAX_TOKENS, MODEL, PROMPTS, reference_text  # noqa: E402

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir(MODEL), "--lora-modules", f"a={adapter_dir(MODEL, 'qv_r4')}",
                         "--max-model-len", "256", "--speculative-config", SPEC)
    yield proc
    proc.stop()


def complete(server: ServerProcess, model: str, prompt: str, **kw) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kw)
    if kw.get("stream"):
        return norm_text("".join(c.choices[0].text for c in out))
    return norm_text(out.choices[0].text)


def test_base_and_adapter_rows_share_batches_and_match_peft(server: ServerProcess) -> None:
    jobs = [(m, p, i % 2 == 1) for i, p in enumerate(PROMPTS) for m in (server.model, "a")]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda j: complete(server, j[0], j[1], stream=j[2]), jobs))
    for (model, prompt, _), text in zip(jobs, texts):
        assert text == reference_text(None if model == server.model else "qv_r4", prompt), (model, prompt)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert metric_value(metrics, "loraplex:spec_decode_num_draft_tokens_total") > 0
    assert metric_value(metrics, "loraplex:spec_decode_num_accepted_tokens_total") >= 0
    assert 'loraplex:spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in metrics
    assert metric_value(metrics, "loraplex:spec_decode_mean_acceptance_length") >= 1.0


def test_json_schema_validates(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}, "y": {"type": "boolean"}},
              "required": ["x", "y"], "additionalProperties": False}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert out.choices[0].finish_reason == "stop", out.choices[0]
    assert set(json.loads(out.choices[0].message.content)) == {"x", "y"}


def test_bad_config_stops_startup_naming_the_field() -> None:
    proc = subprocess.run([*loraplex_command(), "serve", "--model", str(model_dir(MODEL)), "--device", "cpu",
                           "--speculative-config", '{"method": "ngram"}'], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "num_speculative_tokens" in proc.stderr
