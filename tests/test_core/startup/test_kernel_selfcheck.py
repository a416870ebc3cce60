"""The start-up kernel self-check (`core/startup/kernel_selfcheck.py`) on `kernel_device()`: compiled on a GPU,
in the Triton interpreter on the CPU without one.

One engine (a one-layer model, one adapter on every projection, split-KV as on a GPU) with every part on
its Triton path: the real kernels pass; a kernel made wrong on purpose (attention, LoRA segmented expand,
a BGMV half, a fused op, the bitmask apply) stops `warmup()` with `KernelSelfCheckError` naming that kernel
and its torch switch, and that switch makes the same engine start. The self-check launches exactly the
warm-up's kernel variants (recorded specialization keys).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM  # noqa: E402
from core.startup.kernel_selfcheck import KernelCheck, KernelSelfCheck, KernelSelfCheckError, max_abs_error, \
    selfcheck_enabled  # noqa: E402
from envlib import setenv  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from kernel_recorder import KernelRecorder  # noqa: E402
from lora_fixtures import adapter_dir, torch_threads  # noqa: E402
from testlib import model_dir  # noqa: E402

MODEL = "llama_gqa_1layer"
SWITCHES = ("LORAPLEX_ATTENTION_BACKEND", "LORAPLEX_LORA_BACKEND", "LORAPLEX_FUSED_OPS", "LORAPLEX_BITMASK_BACKEND")
KERNELS = {"store_kv_kernel", "paged_attention_kernel", "paged_attention_kernel+reduce_splits_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "lora_shrink_kernel", "lora_expand_kernel",
           "bgmv_shrink_kernel", "bgmv_expand_kernel", "bgmv_add_delta_kernel", "_apply_bitmask_kernel"}
# 4 forwards x (K and V store, attention, RMSNorm, RMSNorm+residual (2 outputs), rotary q and k, SiLU, bitmask)
# + 4 fused linears x (4 table configs x (shrink, expand) + BGMV shrink and expand + the delta path's add, on by
# default: LORAPLEX_LORA_OVERLAP)
NUM_CHECKS = 4 * 10 + 4 * (4 * 2 + 2 + 1)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        for var in SWITCHES:
            mp.setenv(var, "triton")
        llm = LLM(str(model_dir(MODEL)), dtype="float32", device=str(kernel_device()),
                  lora_modules={"t-all8": str(adapter_dir(MODEL, "all7_r8"))}, max_loras=1, max_lora_rank=8,
                  max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, warmup=False)
        backend = llm.engine.model.model.layers[0].self_attn.backend
        backend.target_programs, backend.min_partition = 64, 16     # split-KV as on a GPU
        yield llm.engine


@pytest.fixture()
def checked(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[KernelSelfCheck]]:
    """The self-check forced on; yields the checkers the warm-ups used; leaves the engine not warmed up."""
    monkeypatch.setenv("LORAPLEX_KERNEL_SELFCHECK", "1")
    seen: list[KernelSelfCheck] = []
    raise_on_failure = KernelSelfCheck.raise_on_failure

    def spy(self: KernelSelfCheck, device: torch.device) -> None:
        seen.append(self)
        raise_on_failure(self, device)

    monkeypatch.setattr(KernelSelfCheck, "raise_on_failure", spy)
    engine.warmup_report = None
    yield seen
    engine.warmup_report = None


def test_the_real_kernels_pass_on_the_warmup_variants(engine: Any, checked: list[KernelSelfCheck],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rec = KernelRecorder.install(monkeypatch)
    report = engine.warmup()
    assert engine.ready and report.num_kernel_checks == NUM_CHECKS
    assert {c.kernel.split(" ")[0] for c in checked[0].checks} == KERNELS
    assert all(c.ok for c in checked[0].checks)
    with_check = set(rec.keys)
    rec.reset()
    setenv(monkeypatch, "LORAPLEX_KERNEL_SELFCHECK", "0")
    engine.warmup_report = None
    assert engine.warmup().num_kernel_checks == 0 and len(checked) == 1
    assert rec.keys == with_check, "the self-check launched kernel variants the warm-up does not compile"


def _scaled(fn: Callable[..., Any], arg: int | None = None) -> Callable[..., Any]:
    """fn with its output (arg None) or its argument number `arg` scaled by 1.01."""
    def wrong(*args: Any, **kwargs: Any) -> Any:
        if arg is not None:
            args = tuple(a * 1.01 if i == arg else a for i, a in enumerate(args))
            return fn(*args, **kwargs)
        return fn(*args, **kwargs) * 1.01
    return wrong


def _break(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.lora_ops import bgmv, triton_ops
    from core.attention.triton_backend import TritonAttentionBackend
    from core.models import fused_ops
    from grammar.matching import bitmask_triton

    if name == "attention":
        monkeypatch.setattr(TritonAttentionBackend, "forward", _scaled(TritonAttentionBackend.forward))
    elif name == "lora":     # the expand of the segmented path adds 1.01 x the delta
        monkeypatch.setattr(triton_ops, "triton_expand", _scaled(triton_ops.triton_expand, arg=1))
    elif name == "bgmv":     # the shrink half of bgmv_split
        monkeypatch.setattr(bgmv, "triton_bgmv_shrink", _scaled(bgmv.triton_bgmv_shrink))
    elif name == "fused":    # only the Triton path of SiLU-and-mul is wrong
        silu = fused_ops.silu_and_mul
        monkeypatch.setattr(fused_ops, "silu_and_mul",
                            lambda x: silu(x) * (1.01 if fused_ops.use_triton(x) else 1.0))
    else:                    # the bitmask kernel forgets the last constrained row
        apply = bitmask_triton.apply_token_bitmask_triton_
        monkeypatch.setattr(bitmask_triton, "apply_token_bitmask_triton_",
                            lambda logits, mask, rows: apply(logits, mask, rows[:-1]))


WRONG = {  # broken part -> (kernel named in the error, family, the switch it names)
    "attention": ("paged_attention_kernel", "attention", "LORAPLEX_ATTENTION_BACKEND=torch"),
    "lora": ("lora_expand_kernel", "lora", "LORAPLEX_LORA_BACKEND=torch"),
    "bgmv": ("bgmv_shrink_kernel", "lora", "LORAPLEX_LORA_BACKEND=torch"),
    "fused": ("_silu_and_mul_kernel", "fused", "LORAPLEX_FUSED_OPS=torch"),
    "bitmask": ("_apply_bitmask_kernel", "bitmask", "LORAPLEX_BITMASK_BACKEND=torch"),
}


@pytest.mark.parametrize("broken", list(WRONG))
def test_a_wrong_kernel_stops_the_engine(engine: Any, checked: list[KernelSelfCheck], broken: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, family, switch = WRONG[broken]
    if family != "lora":   # faster: no LoRA variants
        monkeypatch.setenv("LORAPLEX_LORA_BACKEND", "torch")
    _break(broken, monkeypatch)
    with pytest.raises(KernelSelfCheckError) as info:
        engine.warmup()
    assert not engine.ready
    failures = info.value.failures
    assert failures and {f.family for f in failures} == {family}
    assert all(f.kernel.startswith(kernel) for f in failures)
    message = str(info.value)
    assert kernel in message and switch in message and "max abs error" in message and "tolerance" in message
    if broken in ("bitmask", "fused"):   # the switch named starts the same engine (attention's is read at build)
        var, value = switch.split("=")
        setenv(monkeypatch, var, value)
        report = engine.warmup()
        assert engine.ready and report.num_kernel_checks > 0


def test_comparison_and_tolerances(monkeypatch: pytest.MonkeyPatch) -> None:
    inf = math.inf
    assert max_abs_error(torch.tensor([1.0, -inf]), torch.tensor([1.5, -inf])) == (0.5, 1.5)
    assert max_abs_error(torch.tensor([1.0, -inf]), torch.tensor([1.0, 2.0]))[0] == inf
    assert max_abs_error(torch.tensor([math.nan]), torch.tensor([math.nan]))[0] == inf
    check = KernelSelfCheck()
    want = torch.linspace(-4, 4, 9)
    check.compare("a", "lora", want * (1 + 1e-5), want, torch.float32)
    check.compare("b", "lora", want * 1.01, want, torch.float32)
    check.compare("c", "lora", want * 1.01, want, torch.bfloat16)
    check.compare("d", "bitmask", want + 1e-6, want, torch.float32, exact=True)
    assert [c.ok for c in check.checks] == [True, False, True, False]
    assert check.checks[1] == KernelCheck("b", "lora", "float32", pytest.approx(0.04), pytest.approx(8e-4))
    for value, cuda, cpu in (("", True, False), ("auto", True, False), ("1", True, True), ("0", False, False)):
        setenv(monkeypatch, "LORAPLEX_KERNEL_SELFCHECK", value)
        assert selfcheck_enabled(torch.device("cuda")) is cuda and selfcheck_enabled(torch.device("cpu")) is cpu
    setenv(monkeypatch, "LORAPLEX_KERNEL_SELFCHECK", "yes")
    with pytest.raises(ValueError, match="LORAPLEX_KERNEL_SELFCHECK"):
        selfcheck_enabled(torch.device("cpu"))


def test_the_lora_delta_kernels_are_checked_when_overlap_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """LORAPLEX_LORA_OVERLAP=1: the warm-up also launches and checks the LoRA delta path the graphs then run beside
    the base GEMMs (its expand into the delta and its add); a wrong add stops the engine, naming its kernel and the
    torch switch."""
    from adapters.lora_ops import bgmv_overlap

    for var in (*SWITCHES, "LORAPLEX_LORA_OVERLAP", "LORAPLEX_KERNEL_SELFCHECK"):
        setenv(monkeypatch, var, "1" if var in ("LORAPLEX_LORA_OVERLAP", "LORAPLEX_KERNEL_SELFCHECK") else "triton")
    setenv(monkeypatch, "LORAPLEX_BITMASK_BACKEND", "torch")        # faster: only the LoRA and forward kernels
    seen: list[KernelSelfCheck] = []
    raise_on_failure = KernelSelfCheck.raise_on_failure
    monkeypatch.setattr(KernelSelfCheck, "raise_on_failure",
                        lambda self, device: (seen.append(self), raise_on_failure(self, device))[1])
    with torch_threads(1):
        llm = LLM(str(model_dir(MODEL)), dtype="float32", device=str(kernel_device()),
                  lora_modules={"t-all8": str(adapter_dir(MODEL, "all7_r8"))}, max_loras=1, max_lora_rank=8,
                  max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, warmup=False)
        engine = llm.engine
        assert engine.lora_pool.context.backends.decode_overlap
        engine.warmup()
        delta = [c for c in seen[0].checks if c.kernel.startswith("bgmv_add_delta_kernel")]
        assert len(delta) == 4 and all(c.ok for c in delta), delta        # one per fused linear
        monkeypatch.setattr(bgmv_overlap, "triton_bgmv_add_delta", _scaled(bgmv_overlap.triton_bgmv_add_delta, arg=1))
        engine.warmup_report = None
        with pytest.raises(KernelSelfCheckError) as info:
            engine.warmup()
    failures = info.value.failures
    assert failures and all(f.kernel.startswith("bgmv_add_delta_kernel") for f in failures)
    assert "LORAPLEX_LORA_BACKEND=torch" in str(info.value)
