"""Greedy outputs are identical with the prefix cache on and off (and equal HF), and the cache is used."""
from __future__ import annotations

import random
from pathlib import Path

from engine_builders import GREEDY, make_engine
from testlib import encode, hf_greedy, run_staggered

SYSTEM = "# You are a helpful assistant that writes short, correct Python code.\n" * 3


def run_both(path: Path, prompts: list[list[int]], **kw) -> tuple[dict, dict, object]:
    on = make_engine(path, prefix=True, **kw)
    off = make_engine(path, prefix=False, **kw)
    out_on = run_staggered(on, prompts, GREEDY, check=True)
    out_off = run_staggered(off, prompts, GREEDY)
    assert out_on == out_off
    for i, ids in enumerate(prompts):
        assert out_on[str(i)] == hf_greedy(path, ids, 24), f"request {i}"
    on.check_integrity()
    return out_on, out_off, on


def test_shared_system_prompt(tiny_model: Path) -> None:
    questions = ["def add(a, b):", "import json", "class Stack:", "for x in data:", "# sort a list", "x = {}"]
    prompts = [encode(tiny_model, SYSTEM + q) for q in questions]
    _, _, engine = run_both(tiny_model, prompts)
    assert engine.kv.num_prefix_hit_tokens >= (len(prompts) - 2) * (len(encode(tiny_model, SYSTEM)) // 16) * 16


def test_multi_turn_replay(tiny_model: Path) -> None:
    engine_on = make_engine(tiny_model, prefix=True)
    engine_off = make_engine(tiny_model, prefix=False)
    history = encode(tiny_model, SYSTEM + "def parse(line):")
    for turn in range(4):
        outs = []
        for engine in (engine_on, engine_off):
            got = run_staggered(engine, [history], GREEDY)["0"] if turn == 0 else None
            if got is None:
                engine.add_request(f"t{turn}", history, GREEDY)
                got = []
                while engine.has_unfinished_requests():
                    for d in engine.step():
                        got.extend(d.new_token_ids)
            outs.append(got)
        assert outs[0] == outs[1] == hf_greedy(tiny_model, history, 24), f"turn {turn}"
        history = history + outs[0] + encode(tiny_model, "\n# next\n")[1:]
    assert engine_on.kv.num_prefix_hit_tokens > 0
    engine_on.check_integrity()


def test_duplicates_and_diverging_inside_a_block(tiny_model: Path) -> None:
    rng = random.Random(3)
    base = encode(tiny_model, SYSTEM)
    prompts = [base, base, base + [7], base[:-5] + [9, 9, 9], base[:37] + [11] * 9, base[:40] + [5], base]
    prompts += [base[:rng.randint(10, len(base))] + [rng.randrange(10, 400)] for _ in range(6)]
    run_both(tiny_model, prompts)


def test_in_batch_dedup_computes_shared_prefix_once(tiny_model: Path) -> None:
    prompt = encode(tiny_model, SYSTEM + "def main():")
    engine = make_engine(tiny_model, prefix=True)
    for i in range(4):
        engine.add_request(str(i), prompt + [100 + i], GREEDY)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(4)}
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs[d.request_id].extend(d.new_token_ids)
    full_blocks = len(prompt) // 16 * 16
    computed_prompt_tokens = engine.stats.num_batched_tokens - sum(len(o) - 1 for o in outputs.values())
    ideal = len(prompt) + 1 + 3 * (len(prompt) + 1 - full_blocks)
    assert computed_prompt_tokens == ideal
    for i in range(4):
        assert outputs[str(i)] == hf_greedy(tiny_model, prompt + [100 + i], 24)


def test_preemption_with_shared_prefixes(tiny_model: Path) -> None:
    base = encode(tiny_model, SYSTEM)
    prompts = [base[: 20 + 7 * i] + [50 + i] for i in range(10)]
    _, _, engine = run_both(tiny_model, prompts, num_blocks=10, budget=48)
    assert engine.scheduler.num_preemptions > 0


def test_cold_requests_are_not_starved(tiny_model: Path) -> None:
    """A cold request behind a stream of cache hits is admitted within the aging bound."""
    engine = make_engine(tiny_model, prefix=True, max_num_seqs=2)
    hot = encode(tiny_model, SYSTEM + "x = 1")
    engine.add_request("warm", hot, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("cold", encode(tiny_model, "import random\nrandom.seed(0)\n"), GREEDY)
    admitted_at = None
    for i in range(400):
        if i % 2 == 0:
            engine.add_request(f"hot{i}", hot + [i % 300 + 5], GREEDY)
        for d in engine.step():
            pass
        if admitted_at is None and engine.scheduler.requests.get("cold") is not None \
                and engine.scheduler.requests["cold"].status.value == "running":
            admitted_at = engine.scheduler.num_steps
        if admitted_at is not None:
            break
    assert admitted_at is not None and admitted_at <= engine.scheduler.waiting.max_wait_steps + 30
