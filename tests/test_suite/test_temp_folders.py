"""What the suite's model builders and the benchmarks write in the temp folder is gone when their process ends
(tests/helpers/scratch_dirs.py): thousands of runs had left 5 GB of loraplex_tiny_*, loraplex_lora_*,
loraplex_tree_*, loraplex_jitter_*, ... folders in /tmp.

The builder and benchmark checks run the code in a process of its own whose TMPDIR is an empty folder of the test,
and look at that folder once the process is gone: it must be empty again, and the code must have written there
meanwhile (so an empty folder is not code that wrote elsewhere). tests/test_benchmarks/test_gpu_run.py does the
same for every stage of the GPU run's dry run; tests/test_core/native/test_native_build_folder.py for the C
kernels' build folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS)]),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


# torch's own per-user caches: one folder a user, reused by every run (not a leak of ours)
SHARED_CACHES = ("torchinductor_",)


def _left(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith(SHARED_CACHES))


def test_the_model_builders_remove_their_folders_at_exit(tmp_path: Path) -> None:
    """A tiny model (tiny_models), a PEFT adapter of a suite model (lora_fixtures), an adapter tree (lora_tree) and
    the MoE-quant module imported (it made its folder at import): each folder is in TMPDIR while the process runs,
    none is left after it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = textwrap.dedent("""
        import os, tempfile
        from pathlib import Path
        import lora_fixtures, lora_tree, moe_quant_models
        from testlib import model_dir
        from tiny_models import TinyModelSpec, tiny_model_dir

        made = [tiny_model_dir(TinyModelSpec(num_layers=1, hidden_size=32, intermediate_size=64, seed=7)),
                lora_fixtures.adapter_dir("llama_gqa", "qv_r4"), lora_tree.adapter_tree(model_dir("llama_gqa"), 2)]
        tmp = Path(tempfile.gettempdir()).resolve()
        assert all(p.resolve().is_relative_to(tmp) and p.is_dir() for p in made), (made, tmp)
        print("inside:", sorted(os.listdir(tmp)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env(tmp), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loraplex_tiny_" in proc.stdout and "loraplex_lora_" in proc.stdout and "loraplex_tree_" in proc.stdout
    assert _left(tmp) == [], _left(tmp)


def test_a_benchmark_interrupted_by_ctrl_c_removes_its_folders(tmp_path: Path) -> None:
    """benchmarks/lora_overhead.py on the tiny dummy model, interrupted (SIGINT, as Ctrl-C sends it) once it has
    written its model and adapters: it stops with KeyboardInterrupt and neither folder is left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lora_overhead.py"), "--model", "tiny-dummy", "--phases", "e2e",
           "--num-requests", "2", "--prompt-len", "4", "--max-tokens", "3000", "--num-adapters", "1",
           "--name", "interrupted"]
    proc = subprocess.Popen(cmd, env=_env(tmp, LORAPLEX_BENCH_RESULTS=str(tmp_path / "results")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp.glob("loraplex_bench_*/t0/adapter_model.safetensors")) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        seen = _left(tmp)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(n.startswith("loraplex_tiny-dummy_") for n in seen) and any(n.startswith("loraplex_bench_")
                                                                            for n in seen), seen
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out[-3000:]
    assert _left(tmp) == [], _left(tmp)


def test_under_pytest_the_builders_write_inside_the_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tests/conftest.py puts this process's scratch folders in pytest's basetemp (rotated by pytest): a run killed
    before its exit leaves them there, not in the temp folder itself."""
    from scratch_dirs import scratch_dir

    path = scratch_dir("loraplex_probe_")
    assert path.parent == tmp_path_factory.getbasetemp(), path


def test_no_bare_mkdtemp_in_the_tests_benchmarks_or_examples() -> None:
    """A folder made by `tempfile.mkdtemp` (or a file by `mkstemp`) is never removed unless its maker does it: the
    suite, the benchmarks and the examples make theirs with `scratch_dir`, TemporaryDirectory or pytest's tmp_path."""
    allowed = {HELPERS / "scratch_dirs.py", Path(__file__).resolve()}
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("tests", "benchmarks", "examples")
             for path in sorted((ROOT / folder).rglob("*.py")) if path.resolve() not in allowed
             for n, line in enumerate(path.read_text().splitlines(), 1) if "mkdtemp(" in line or "mkstemp(" in line]
    assert not found, found
