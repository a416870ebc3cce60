"""The soak tests' server configuration (tests/test_gateway/robustness/): the tiny Llama with two LoRA
adapters, a small KV pool (preemption by recompute), a small token budget (chunked prefill), the admin token.

    srv = soak_server(lora_modules(ADAPTERS), num_kv_blocks=16)     # an InProcessServer (tests/helpers/inprocess_server.py)
"""
from __future__ import annotations

from typing import Any

from inprocess_server import InProcessServer
from lora_fixtures import adapter_dir

MODEL = "llama_gqa"
SERVED = "tiny-soak"
ADMIN_TOKEN = "soak-admin-token"
ADAPTERS = {"a": "qv_r4", "b": "all7_r8"}     # served name -> tests/helpers/lora_fixtures.py adapter
HOT = "hot"
HOT_ADAPTERS = ("rs_kod_r16", "all7_r8_v2")   # reloads change rank and target modules
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 32                            # ~ 16 requests of ~2 blocks: the workload preempts
MAX_BATCHED_TOKENS = 32                       # longer prompts are prefilled in chunks
INTEGRITY_EVERY_STEPS = 25                    # check_integrity() on the engine thread every this many steps


def lora_modules(adapters: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """(served name, adapter folder) pairs of `adapters` (served name -> lora_fixtures adapter)."""
    return tuple((name, str(adapter_dir(MODEL, a))) for name, a in adapters.items())


def soak_server(lora_modules: tuple[tuple[str, str], ...], num_kv_blocks: int = NUM_KV_BLOCKS,
                max_num_batched_tokens: int = MAX_BATCHED_TOKENS, **overrides: Any) -> InProcessServer:
    """The soak's configuration: the tiny Llama, a small KV pool and token budget, the admin token."""
    return InProcessServer(MODEL, SERVED, lora_modules, num_kv_blocks, max_num_batched_tokens, ADMIN_TOKEN,
                           block_size=BLOCK_SIZE, **overrides)
