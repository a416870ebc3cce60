"""`LLM.generate` interrupted (Ctrl-C in a notebook, or a step that raised) gives back what its requests hold:
they are aborted, so the engine is idle and sound and the next `generate` runs (the requests used to stay in the
engine: the next call stepped them too and failed with a KeyError on their ids)."""
from __future__ import annotations

from typing import Any

import pytest

from core import LLM, SamplingParams
from testlib import model_dir

MODEL = "llama_gqa"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "step-error"])
def test_an_interrupted_generate_leaves_the_engine_idle(monkeypatch: pytest.MonkeyPatch, interrupt: type) -> None:
    with LLM(model=str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2)
        clean = llm.generate(["def f(x):", "import os"], params)
        step, calls = engine.step, [0]

        def interrupted_step() -> Any:
            calls[0] += 1
            if calls[0] == 5:   # mid-decode
                raise interrupt("interrupted")
            return step()
        monkeypatch.setattr(engine, "step", interrupted_step)
        with pytest.raises(interrupt):
            llm.generate(["def f(x):", "import os"], params)
        monkeypatch.undo()
        assert not engine.has_unfinished_requests()
        assert engine.kv.usage() == 0.0
        engine.check_integrity()
        again = llm.generate(["def f(x):", "import os"], params)
        assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in clean]
