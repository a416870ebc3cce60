"""Zero compiles while serving: the start-up warm-up launches every Triton kernel variant the engine can use.

On `kernel_device()` (compiled on a GPU, the CPU interpreter without one) every launch's specialization key
(constexprs, integer and pointer-alignment specializations, launch options: exactly what Triton's JIT cache is
keyed on) is recorded, first during the warm-up, then during a randomized mixed workload: prefill chunks of many
sizes up to the token budget, decode batches of 1..max_num_seqs on the padded (CUDA-graph) path, run without
capture so each step's launches are seen, 0..max_loras adapters of ranks 4-64 in a step, JSON-schema rows.
Every key of the workload must be one the warm-up compiled.
"""
from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.execution.cuda_graphs import DecodeGraphRunner  # noqa: E402
from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from envlib import setenv  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from kernel_recorder import KernelRecorder  # noqa: E402
from lora_fixtures import adapter_dir, torch_threads  # noqa: E402
from testlib import PROMPTS, encode, model_dir  # noqa: E402

MODEL = "llama_gqa_1layer"     # one layer: the launch keys of every layer are the same
ADAPTERS = {"t-qv4": "qv_r4", "t-all8": "all7_r8", "t-kod16": "rs_kod_r16", "t-r64": "qkvo_gu_r64",
            "t-vocab": "vocab_r8"}
SIZES = (1, 2, 4, 8)
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"], "additionalProperties": False}}}
FAMILIES = {"paged_attention_kernel", "reduce_splits_kernel", "store_kv_kernel", "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
            "lora_shrink_kernel", "lora_expand_kernel", "bgmv_shrink_kernel", "bgmv_expand_kernel",
            "_apply_bitmask_kernel"}


@pytest.fixture()
def triton_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LORAPLEX_ATTENTION_BACKEND", "LORAPLEX_LORA_BACKEND", "LORAPLEX_FUSED_OPS",
                "LORAPLEX_BITMASK_BACKEND"):
        monkeypatch.setenv(var, "triton")


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams], list[str | None], list[dict | None]]:
    rng = random.Random(seed)
    path = model_dir(MODEL)
    prompts, params, loras, formats = [], [], [], []
    for i in range(8):
        text = "".join(rng.choice(PROMPTS) for _ in range(3))
        ids = encode(path, text)
        prompts.append(ids[:rng.randint(1, min(len(ids), 40))])
        params.append(SamplingParams(max_tokens=rng.randint(2, 7), temperature=rng.choice([0.0, 0.8]),
                                     seed=rng.randint(0, 99)))
        loras.append(rng.choice([None, *ADAPTERS]))
        formats.append(SCHEMA if i % 4 == 1 else None)
    return prompts, params, loras, formats


@pytest.mark.parametrize("lora_overlap", ["1", "0"])
def test_serving_launches_only_warmed_up_variants(monkeypatch: pytest.MonkeyPatch, triton_everywhere: None,
                                                  lora_overlap: str) -> None:
    """With the decode LoRA beside the base GEMMs (LORAPLEX_LORA_OVERLAP=1, the default: its delta kernels) and
    after them (0: the fused expand adds into the output), serving launches only what the warm-up compiled."""
    setenv(monkeypatch, "LORAPLEX_LORA_OVERLAP", lora_overlap)
    rec = KernelRecorder.install(monkeypatch)
    mods = {name: str(adapter_dir(MODEL, a)) for name, a in ADAPTERS.items()}
    with torch_threads(1):
        llm = LLM(str(model_dir(MODEL)), dtype="float32", device=str(kernel_device()), lora_modules=mods, max_loras=4,
                  max_lora_rank=64, max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=128, warmup=False)
        engine = llm.engine
        assert not engine.ready and not rec.keys
        # split-KV as on a GPU (the interpreter's default never splits), at the tiny model's context lengths
        backend = engine.model.model.layers[0].self_attn.backend
        backend.target_programs, backend.min_partition = 64, 16
        # the padded decode path the GPU captures as graphs, run without capture (every launch recorded)
        pool = engine.lora_pool
        engine.runner.graphs = DecodeGraphRunner(
            engine.model, engine.kv_caches, backend, engine.block_size,
            engine.max_model_len, SIZES, lora=GraphLoRABuffers(SIZES[-1], pool.num_slots, engine.device),
            lora_context=pool.context, use_graphs=False)
        report = engine.warmup()
        # 4 forwards (decode, mixed; each with and without split-KV) + 4 fused linears x (4 table configs + BGMV
        # + with the overlap, the BGMV delta path) + the embedding's and the LM head's LoRA x 4 table configs
        per_linear = 4 + 1 + (lora_overlap == "1")
        assert engine.ready and report.num_variants == 4 + 4 * per_linear + 2 * 4
        assert report.num_graphs == 2 * len(SIZES)
        warm = set(rec.keys)
        rec.reset()
        prompts, params, loras, formats = workload(0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=loras, response_format=formats)
        # then short prompts on every adapter: their prefills fit one step, the rest are decode-only LoRA steps
        short = [encode(model_dir(MODEL), t)[:4] for t in PROMPTS[:len(ADAPTERS) + 1]]
        outs += llm.generate([{"prompt_token_ids": p} for p in short], SamplingParams(max_tokens=5, temperature=0.0),
                             lora=[None, *ADAPTERS])
        assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert engine.runner.graphs.num_runs > 0, "the workload never took the padded decode path"
    assert FAMILIES <= rec.kernels(), f"kernels never launched by the workload: {FAMILIES - rec.kernels()}"
    new = rec.keys - warm
    assert not new, "launch keys the warm-up did not compile:\n" + "\n".join(repr(k) for k in sorted(new, key=repr))
    engine.check_integrity()


def test_every_layer_launches_the_warmed_up_lora_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up launches the segmented LoRA kernels on scratch copies of layer 0's stacks; serving launches
    them on every layer's views of the slot pool. With 3 slots a layer's int32 ranks table is 12 / 24 / 36
    bytes, so a contiguous pool started layer 1's ranks, scalings and DoRA flags off the 16-byte boundary:
    other pointer specializations, compiled by the first prefill with an adapter (6 segmented variants in
    the interpreter). Two layers, LoRA kernels only (attention on the torch path: cheap). On CUDA the mixed-step
    graphs would replay the prefill (per-token BGMV, nothing launched to record): off, so the prefill runs eagerly
    on the segmented kernels as it does past the graphs' largest size."""
    monkeypatch.setenv("LORAPLEX_LORA_BACKEND", "triton")
    monkeypatch.setenv("LORAPLEX_MIXED_GRAPHS", "0")
    rec = KernelRecorder.install(monkeypatch)
    model = "llama_gqa"                       # two layers
    with torch_threads(1):
        llm = LLM(str(model_dir(model)), dtype="float32", device=str(kernel_device()), max_loras=3, max_lora_rank=8,
                  lora_modules={"all": str(adapter_dir(model, "all7_r8"))}, max_num_seqs=4, num_kv_blocks=64,
                  warmup=False)
        assert llm.engine.model_config.num_layers == 2 and llm.engine.lora_pool.num_slots == 3
        llm.engine.warmup()
        warm = set(rec.keys)
        rec.reset()
        ids = encode(model_dir(model), PROMPTS[0])[:6]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=3, temperature=0.0), lora="all")
    assert out[0].outputs[0].finish_reason == "length"
    lora = {k for k in rec.keys if k[0] in ("lora_shrink_kernel", "lora_expand_kernel")}
    assert {name for name, _ in lora} == {"lora_shrink_kernel", "lora_expand_kernel"}
    new = lora - warm
    assert not new, "LoRA launch keys the warm-up did not compile:\n" + "\n".join(map(repr, sorted(new, key=repr)))


def test_compile_counter_counts_after_the_warmup_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter behind loraplex:kernel_compiles_after_warmup_total, through Triton's own JIT cache hook."""
    from types import SimpleNamespace

    from triton import knobs

    from core.startup.kernel_compiles import CompileCounter

    seen: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name))
    counter = CompileCounter()
    assert counter.install() and counter.after_warmup == 0
    knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="warm_kernel"))
    counter.mark_warmup_end()
    assert counter.total == 1 and counter.after_warmup == 0
    knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="late_kernel"))
    assert counter.after_warmup == 1 and counter.names == {"warm_kernel": 1, "late_kernel": 1}
    assert seen == ["warm_kernel", "late_kernel"], "a hook installed before ours must still run"


def test_a_second_engine_warmup_is_neither_a_stall_nor_a_reset(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """benchmarks/lora_overhead.py builds one LLM per adapter count in one process. The second engine's warm-up
    compiles (a new slot count is a new `stride_rank_s` specialization of every LoRA kernel: the GPU run's 18)
    were warned about as stalls, and its end re-based the count, so compiles after the first warm-up vanished
    from `after_warmup` and a benchmark reading it across engines saw 0. Compiles are simulated through Triton's
    hook (the interpreter compiles nothing): the warm-up's own from inside its variants, stalls from a step's
    thread and from another thread while a warm-up is open."""
    import threading
    from types import SimpleNamespace

    from triton import knobs

    from core.startup import warmup as warmup_module
    from core.startup.kernel_compiles import CompileCounter

    def compile_(name: str) -> None:
        knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name=name))

    counter = CompileCounter()
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(warmup_module, "COMPILES", counter)
    assert counter.install()
    engine_warmups = iter(["engine1_kernel", "engine2_kernel"])
    monkeypatch.setattr(warmup_module, "kernel_variants", lambda engine: [
        warmup_module.KernelVariant("test", "compiles", lambda name=next(engine_warmups): compile_(name))])
    caplog.set_level("WARNING", logger="loraplex.kernels")
    path = str(model_dir(MODEL))
    first = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16)
    assert first.engine.warmup_report.num_jit_compiles == 1 and counter.after_warmup == 0
    compile_("stall_1")                                   # a step of the first engine
    before = counter.after_warmup
    second = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16)
    assert second.engine.warmup_report.num_jit_compiles == 1
    assert counter.after_warmup == before == 1, "the second warm-up reset the count or counted its own compiles"
    compile_("stall_2")
    with counter.warming_up():                            # a warm-up open on this thread is not another's
        thread = threading.Thread(target=compile_, args=("stall_3",))
        thread.start()
        thread.join()
    assert counter.after_warmup - before == 2
    assert counter.late_names == {"stall_1": 1, "stall_2": 1, "stall_3": 1}
    assert counter.total == 5 and set(counter.names) == {"engine1_kernel", "engine2_kernel", "stall_1", "stall_2",
                                                         "stall_3"}
    warned = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
    assert warned == [f"Triton compiled {n} after the warm-up (a step stalled on it)" for n in
                      ("stall_1", "stall_2", "stall_3")], warned
