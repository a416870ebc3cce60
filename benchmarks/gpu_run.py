"""The GPU benchmark run: every GPU figure of the project in stages of at most 9 minutes, resumable, ending in one
table of each figure beside its target and its physical floor (benchmarks/gpu_summary.py).

    bash benchmarks/gpu_run.sh                 # on a lent GPU: the next pending stages that fit --budget-s, then the table
    python benchmarks/gpu_run.py --dry-run     # the CPU: every stage at tiny shapes, the table with "not measured (dry run)"
    python benchmarks/gpu_run.py --list        # the stages, their state and estimates

Stages run in order (`STAGES`), each as subprocesses with its own time limit (<= 540 s; the dry run forks this
process instead, which imported torch once). Each writes its results
under <results>/gpu_run/ (<results>: benchmarks/results, or --results) together with `<stage>.stage.json` (status,
seconds, the commands, the log's tail): a later call skips stages that finished ("ok") and goes on with the
next; a failed or timed-out stage is retried only when named (`--stages`) or with --retry-failed, and a stage
named in `--stages` runs whatever its state (one that finished, e.g. the tests after a fix, too). After every
stage the state folder is packed into $OUT/gpu_run.tar.gz (when OUT is set): unpack it into the repository before
the next call (`tar xzf .../gpu_run.tar.gz -C <repo>`), so a fresh machine resumes too. The summary stage runs at
the end of every call: the table it prints last covers every stage, pending ones as "not measured yet".
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
STAGE_DIR = "gpu_run"          # under the results folder
MAX_STAGE_S = 540              # 9 minutes: a device call allows 10


@dataclass(frozen=True)
class Stage:
    name: str
    estimate_s: int            # seconds, cold Triton cache: measured on an H200 on 2026-11-26 (x1.3, rounded up)
    commands: Callable[[bool], list[list[str]]]      # dry -> the scripts and arguments to run, in order
    what: str


def _model(dry: bool) -> list[str]:
    return ["--model", "tiny-dummy", "--device", "cpu", "--dtype", "float32"] if dry else \
        ["--model", "llama3-8b-dummy", "--device", "cuda", "--dtype", "bfloat16"]


def _out(name: str) -> list[str]:
    return ["--name", f"{STAGE_DIR}/{name}"]


def _dry(dry: bool) -> list[str]:
    return ["--dry-run"] if dry else []


def _serving(dry: bool, name: str, *server_env: str) -> list[str]:
    """serving.py's command for the serving stage `name`, its server run with `server_env` (NAME=VALUE) set: the
    step trace on, saturation and 50% / 80% of it (the dry run: a tiny model, two rates, six requests)."""
    env = [arg for pair in server_env for arg in ("--server-env", pair)]
    return ["serving.py", *_model(dry), *_out(name), "--step-trace", *env,
            *(["--rates", "inf,0.5x", "--num-requests", "6", "--prompt-len", "16,40", "--output-len", "3,8",
               "--num-adapters", "2", "--max-loras", "2", "--startup-timeout-s", "120",
               "--kv-cache-memory", str(32 << 20)] if dry else
              ["--rates", "inf,0.5x,0.8x", "--num-requests", "96", "--max-seconds", "420"])]


STAGES = (
    Stage("env", 15, lambda d: [["gpu_env.py", *_dry(d), *_out("env")]],
          "versions (torch, triton, CUDA, driver, GPU, packages), read bandwidth, bf16 matrix rate"),
    Stage("tests", 100, lambda d: [["gpu_tests.py", *_dry(d), "--timeout-s", "240", *(() if d else ("--workers", "8")),
                                    *_out("tests")]],
          "pytest -m gpu (tests/helpers/gpu_test_files.py) with the installed torch"),
    Stage("kernels", 200, lambda d: [["gpu_kernels.py", *_dry(d), *_out("kernels")]],
          "Triton kernels at 8B serving shapes vs their bytes/FLOP floors"),
    Stage("quant", 75, lambda d: [["quant_layers.py", *_dry(d), *_out("quant")]],
          "W4A16 / W8A16 / FP8 linears vs bf16 cuBLAS and their packed-weight bytes"),
    Stage("roofline", 60, lambda d: [
        ["decode_roofline.py", *_model(d), "--async-scheduling", "on", *_out("roofline_bf16"),
         *(["--batch-sizes", "1,2", "--num-steps", "3", "--prompt-len", "16", "--bandwidth-mib", "8"] if d
           else ["--batch-sizes", "1,8,64,128,256"])],
        ["decode_roofline.py", *_model(d), "--async-scheduling", "on", "--quantization", "fp8", *_out("roofline_fp8"),
         *(["--batch-sizes", "1,2", "--num-steps", "2", "--prompt-len", "16", "--bandwidth-mib", "8"] if d
           else ["--batch-sizes", "1,64"])]],
          "decode step vs the bandwidth roofline (bf16, batch 1-256), FP8 decode step (batch 1, 64)"),
    Stage("lora", 150, lambda d: [["lora_overhead.py", *_model(d), "--phases", "e2e,decode,prefill", *_out("lora"),
                                   *(["--num-requests", "4", "--prompt-len", "16", "--max-tokens", "3",
                                      "--num-adapters", "2", "--decode-steps", "2", "--prefill-prompt-len", "24"] if d
                                     else ["--num-requests", "64", "--prompt-len", "128", "--max-tokens", "64",
                                           "--num-adapters", "8,32", "--prefill-prompt-len", "2048"])]],
          "LoRA decode-step / prefill (2048-token prompts) / generate overhead with 8 and 32 adapters vs their "
          "floors, Triton compiles after the warm-up"),
    Stage("lora_fused", 60, lambda d: [["lora_overhead.py", *_model(d), "--phases", "decode", "--lora-overlap", "0",
                                         *_out("lora_fused"),
                                         *(["--num-requests", "4", "--prompt-len", "16", "--max-tokens", "3",
                                            "--num-adapters", "2", "--decode-steps", "2"] if d
                                           else ["--num-requests", "64", "--prompt-len", "128", "--max-tokens", "64",
                                                 "--num-adapters", "8,32"])]],
          "the LoRA decode step with each fused linear's LoRA after its base GEMM (LORAPLEX_LORA_OVERLAP=0), "
          "8 and 32 adapters: the A/B of the lora stage's decode rows (the LoRA beside the GEMMs, the default)"),
    Stage("host", 90, lambda d: [["host_profile.py", *_model(d), *_dry(d), *_out("host")]],
          "where the host's time goes in an eager step with a 2,000-token chunk beside 64 decode rows, base vs the "
          "32-adapter mix: host ms, device waits by call site (sync debug mode), allocator retries, cProfile"),
    Stage("spec", 100, lambda d: [
        ["spec_verify_cost.py", *_model(d), "--k", "4", *_out("spec_verify"),
         *(["--batch-sizes", "1,2", "--context", "64", "--repeats", "2"] if d else
           ["--batch-sizes", "1,8,32,64", "--context", "1024"])],
        ["spec_ngram_speed.py", *_model(d), "--k", "4", *_out("spec_ngram"),
         *(["--max-tokens", "6", "--num-prompts", "1", "--prompt-chars", "300", "--kv-cache-gib", "0.01",
            "--batch-sizes", "1,2", "--disable-by-batch-size", "1"] if d else
           ["--batch-sizes", "1,32", "--disable-by-batch-size", "8"])]],
          "a verification step (graph-replayed) vs a decode step (batch 1-64); n-gram speculation at batch 1 and "
          "at batch 32 with disable_by_batch_size"),
    Stage("offline", 60, lambda d: [["offline_throughput.py", *_model(d), "--async-scheduling", "on", *_out("offline"),
                                      *(["--num-requests", "4", "--max-prompt", "24", "--max-output", "16",
                                         "--hf-batch-size", "4", "--repeats", "1"] if d else
                                        ["--num-requests", "64", "--hf-batch-size", "64", "--hf-repeats", "1"])]],
          "offline throughput vs HF generate (static batch 64)"),
    Stage("serving", 300, lambda d: [_serving(d, "serving")],
          "HTTP serving: TTFT / ITL / E2E / goodput at saturation and at 50% / 80% of it, 32-adapter mix and base "
          "alone, compiles after warm-up"),
    Stage("serving_eager", 300, lambda d: [_serving(d, "serving_eager", "LORAPLEX_MIXED_GRAPHS=0")],
          "the serving stage again with the mixed-step CUDA graphs off (LORAPLEX_MIXED_GRAPHS=0): their A/B"),
    Stage("serving_fused", 300, lambda d: [_serving(d, "serving_fused", "LORAPLEX_LORA_OVERLAP=0")],
          "the serving stage again with each linear's LoRA after its base GEMM (LORAPLEX_LORA_OVERLAP=0, the default "
          "until 2026-11-27f): the A/B of the LoRA beside the GEMMs"),
    Stage("many", 420, lambda d: [["many_adapters.py", *_model(d), *_out("many"),
                                   *(["--dry-run", "--kv-cache-memory", str(32 << 20), "--startup-timeout-s", "120"]
                                     if d else ["--targets", "qv", "--num-requests", "1000", "--concurrency", "64",
                                                "--max-tokens", "64", "--startup-timeout-s", "240"])]],
          "1,000 --lora-dir adapters (Zipf 1.0) vs 32 over HTTP: tok/s ratio, H2D copies/s, cold TTFT, host memory"),
)
SUMMARY = Stage("summary", 10, lambda d: [["gpu_summary.py", *_dry(d)]], "the table: figure, target, floor")


def stage_file(results: Path, name: str) -> Path:
    return results / STAGE_DIR / f"{name}.stage.json"


def wanted(name: str, status: str, named: list[str] | None, force: bool, retry_failed: bool) -> bool:
    """Whether this call runs a stage: every stage named in `--stages`, whatever its state (naming it is the
    intent: a finished one runs again too); otherwise the pending ones, the finished ones with --force and the failed
    or timed-out ones with --retry-failed."""
    if named is not None:
        return name in named
    if status == "ok":
        return force
    if status in ("failed", "timeout"):
        return retry_failed or force
    return True


def stage_status(results: Path, name: str) -> str:
    path = stage_file(results, name)
    return json.loads(path.read_text())["status"] if path.exists() else "pending"


def run_command(cmd: list[str], env: dict[str, str], limit_s: float, log: Path) -> tuple[int, bool]:
    """Runs one benchmark script in its own process group (killed whole at the limit); output appended to `log`."""
    full = [sys.executable, str(BENCH / cmd[0]), *cmd[1:]]
    with open(log, "a") as out:
        out.write(f"$ {' '.join(full)}\n")
        out.flush()
        proc = subprocess.Popen(full, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, limit_s)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[gpu_run] killed at the stage's limit ({limit_s:.0f} s)\n")
            return -9, True


def run_forked(cmd: list[str], env: dict[str, str], limit_s: float, log: Path) -> tuple[int, bool]:
    """The dry run's way to run a script: in a fork of this process, which imported torch and transformers once for
    every stage (no CUDA here; a GPU run always takes `run_command`). Same arguments, environment, log and limit."""
    script = str(BENCH / cmd[0])
    with open(log, "a") as out:
        out.write(f"$ (fork) {script} {' '.join(cmd[1:])}\n")
        out.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                                   # the child: becomes the script
            code = 1
            try:
                os.setsid()
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.environ.clear()
                os.environ.update(env)
                sys.argv = [script, *cmd[1:]]
                sys.path.insert(0, str(BENCH))
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - reported in the log, the exit code says it failed
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                scratch = sys.modules.get("scratch_dirs")     # os._exit runs no atexit: the script's folders
                if scratch is not None:                       # (tests/helpers/scratch_dirs.py) are removed here
                    scratch.remove_all()
                os._exit(code)
        deadline = time.monotonic() + max(1.0, limit_s)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status), False
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out.write(f"\n[gpu_run] killed at the stage's limit ({limit_s:.0f} s)\n")
                return -9, True
            time.sleep(0.05)


def preload() -> None:
    """The imports every dry-run stage pays (~2 s of CPU each), done once before the forks. Not triton: the kernel
    stages must import it themselves, under TRITON_INTERPRET=1."""
    import httpx  # noqa: F401
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    assert "triton" not in sys.modules


def outputs(stage: Stage, dry: bool) -> list[str]:
    """The result names (`--name` of each command) the stage writes under the results folder."""
    return [cmd[cmd.index("--name") + 1] for cmd in stage.commands(dry) if "--name" in cmd]


def run_stage(stage: Stage, results: Path, dry: bool, env: dict[str, str], limit_s: float) -> dict:
    log = results / STAGE_DIR / f"{stage.name}.log"
    log.write_text("")
    for name in outputs(stage, dry):          # a result on disk is always this attempt's (a part may fail)
        for suffix in (".json", ".md"):
            (results / f"{name}{suffix}").unlink(missing_ok=True)
    start, status, rcs = time.perf_counter(), "ok", []
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    runner = run_forked if dry else run_command
    for cmd in stage.commands(dry):
        rc, timed_out = runner(cmd, env, limit_s - (time.perf_counter() - start), log)
        rcs.append(rc)
        if timed_out or rc != 0:
            status = "timeout" if timed_out else "failed"
            break
    tail = log.read_text(errors="replace")[-4000:]
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime        # of the processes it waited for
    record = {"stage": stage.name, "status": status, "seconds": round(time.perf_counter() - start, 1),
              "cpu_seconds": round(cpu_s, 1), "dry_run": dry,
              "returncodes": rcs, "commands": [" ".join(c) for c in stage.commands(dry)], "what": stage.what,
              "log_tail": tail}
    stage_file(results, stage.name).write_text(json.dumps(record, indent=2))
    print(f"[gpu_run] {stage.name}: {status} in {record['seconds']} s ({record['cpu_seconds']} s of CPU)", flush=True)
    if status != "ok":
        print(tail[-1500:], flush=True)
    return record


def pack(results: Path) -> None:
    """$OUT/gpu_run.tar.gz: the state folder and the final table (one file: a device call returns at most 8)."""
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(out) / "gpu_run.tar.gz", "w:gz") as tar:
        for path in sorted(results.glob(f"{STAGE_DIR}/*")) + sorted(results.glob("gpu_[0-9]*.*")):
            tar.add(path, arcname=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model and shapes; no wheel install needed")
    ap.add_argument("--stages", default=None, help="comma list (default: every pending stage, in order)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no stage whose estimate would end past this (default 540; the dry run: no limit)")
    ap.add_argument("--retry-failed", action="store_true", help="run failed / timed-out stages again")
    ap.add_argument("--force", action="store_true", help="run every stage again, finished ones too (a stage named in "
                    "--stages runs anyway)")
    ap.add_argument("--results", type=Path, default=None,
                    help="results folder (default benchmarks/results; the dry run: benchmarks/results/tmp/gpu_dry)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    dry = args.dry_run
    results = (args.results or (BENCH / "results" / "tmp" / "gpu_dry" if dry else BENCH / "results")).resolve()
    (results / STAGE_DIR).mkdir(parents=True, exist_ok=True)
    if args.list:
        for s in STAGES:
            print(f"{s.name:13s} {stage_status(results, s.name):8s} ~{s.estimate_s:4d} s  {s.what}")
        return 0
    env = {**os.environ, "LORAPLEX_BENCH_RESULTS": str(results), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p])}
    named = args.stages.split(",") if args.stages else None
    unknown = set(named or ()) - {s.name for s in STAGES}
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; stages: {[s.name for s in STAGES]}")
    budget = args.budget_s if args.budget_s is not None else (float("inf") if dry else MAX_STAGE_S)
    if dry:     # one CPU thread per process: on a shared 2-core machine torch's spinning threads doubled the time
        os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
        preload()
    started, ran = time.perf_counter(), []
    for stage in STAGES:
        status = stage_status(results, stage.name)
        if not wanted(stage.name, status, named, args.force, args.retry_failed):
            continue
        elapsed = time.perf_counter() - started
        if ran and elapsed + stage.estimate_s > budget:
            print(f"[gpu_run] {stage.name} (~{stage.estimate_s} s) does not fit this call: run again to go on")
            break
        limit = min(MAX_STAGE_S, budget - elapsed) if not dry else MAX_STAGE_S
        ran.append(run_stage(stage, results, dry, env, limit))
        pack(results)
    summary = run_stage(SUMMARY, results, dry, env, 120)
    pack(results)
    table = results / STAGE_DIR / "summary.md"
    if table.exists():
        print(table.read_text(), flush=True)
    return 0 if summary["status"] == "ok" and all(r["status"] == "ok" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
