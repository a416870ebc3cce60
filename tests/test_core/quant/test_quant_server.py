"""`loraplex serve --quantization ...` over HTTP: base and LoRA completions sent together equal the offline
engine on the same quantized checkpoint (itself proven against HF / PEFT in test_quant_ct.py); a
`--quantization` that contradicts the checkpoint stops start-up with the reason."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("compressed_tensors")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "gateway"))

from core import LLM, SamplingParams  # noqa: E402
from gateway_server import ServerProcess, loraplex_command  # noqa: E402
from quant_models import ct_model, ct_reference_dir, save_all7_adapter  # noqa: E402
from testlib import PROMPTS  # noqa: E402

NAME = "w4a16_asym_g32"


def test_served_base_and_lora_equal_offline() -> None:
    path, adapter = ct_model(NAME), save_all7_adapter(ct_reference_dir(NAME))
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, lora_modules={"tenant": str(adapter)})
    cases = [(p, m) for p in PROMPTS[:2] for m in (str(path), "tenant")]
    expected = [o.text for o in llm.generate([p for p, _ in cases], SamplingParams(max_tokens=10, temperature=0.0),
                                             lora=[None if m != "tenant" else m for _, m in cases])]
    del llm
    server = ServerProcess(path, "--quantization", "compressed-tensors", "--lora-modules", f"tenant={adapter}")
    try:
        def complete(case: tuple[str, str]) -> str:
            body = {"model": case[1], "prompt": case[0], "max_tokens": 10, "temperature": 0.0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
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
