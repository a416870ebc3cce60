"""`loraplex serve --quantization ...` over HTTP: base and LoRA completions sent together (three adapters, so
three device slots) equal HF / PEFT greedy on compressed-tensors' own decompression of the checkpoint; a
`--quantization` that contradicts the checkpoint stops start-up with the reason."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("compressed_tensors")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
from gateway_server import ServerProcess, loraplex_command  # noqa: E402
from lora_fixtures import norm_text  # noqa: E402
from quant_models import ct_model, ct_reference_dir, reference_greedy, save_all7_adapter, slot_adapters  # noqa: E402
from testlib import PROMPTS, _tokenizer, encode  # noqa: E402

NAME = "w4a16_asym_g32"
MAX_TOKENS = 10


def test_served_base_and_adapters_equal_peft() -> None:
    path, ref = ct_model(NAME), ct_reference_dir(NAME)
    prompts = PROMPTS[:2]
    ids = [encode(path, p) for p in prompts]
    adapters = {"tenant": save_all7_adapter(ref), **slot_adapters(ref, ids, MAX_TOKENS, 1e-3)}
    tok = _tokenizer(str(path))
    cases = [(i, m) for i in range(len(prompts)) for m in (None, *adapters)]
    expected = []
    for i, m in cases:
        tokens, margin = reference_greedy(ref, adapters.get(m or ""), ids[i], MAX_TOKENS)
        assert margin > 1e-3, f"test setup: reference near a tie ({m})"
        expected.append(norm_text(tok.decode(tokens, skip_special_tokens=True)))
    mods = [f"{name}={adapter}" for name, adapter in adapters.items()]
    server = ServerProcess(path, "--quantization", "compressed-tensors", "--lora-modules", *mods)
    try:
        def complete(case: tuple[int, str | None]) -> str:
            body = {"model": case[1] or str(path), "prompt": prompts[case[0]], "max_tokens": MAX_TOKENS,
                    "temperature": 0.0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return norm_text(r.json()["choices"][0]["text"])
        with ThreadPoolExecutor(len(cases)) as pool:          # concurrent: base and LoRA rows share steps
            assert list(pool.map(complete, cases)) == expected
    finally:
        server.stop()


def test_contradicting_quantization_flag_fails_startup() -> None:
    cmd = [*loraplex_command(), "serve", "--model", str(ct_model(NAME)), "--device", "cpu", "--port", "0",
           "--quantization", "awq"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--quantization awq but the checkpoint is compressed-tensors" in proc.stdout + proc.stderr
