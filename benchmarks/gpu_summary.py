"""The table of a GPU run (benchmarks/gpu_run.py): every GPU figure beside its target and its physical floor.

Reads what the stages wrote under <results>/gpu_run/ (the same run, the same device) and writes
<results>/gpu_<date>.json and .md (the dry run: gpu_<date>_dry.*) and gpu_run/summary.md; prints the table.
A figure whose stage has not run says so, a failed stage points at its log, and in the dry run every figure that
needs a GPU reads "not measured (dry run)" (its row is still built from the dry run's files, so the parsing is
exercised). A missed target is listed, never hidden. Targets come from the open issues (issue 33 lists them).
Usage: python benchmarks/gpu_summary.py [--dry-run] [--results DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_trace_summary as traces
from gpu_cases import QUANT_FORMATS, QUANT_TOKENS, kernel_names
from gpu_run import STAGE_DIR, STAGES

DRY = "not measured (dry run)"
QUANT_TARGETS = {("w4a16", 1): 2.5, ("w4a16", 16): 2.5, ("w4a16", 64): 1.3, ("w4a16", 256): 0.9,
                 ("w4a16", 1024): 0.9, ("w8a16", 1): 1.6, ("fp8", 1): 1.0, ("fp8", 16): 1.3, ("fp8", 64): 1.3,
                 ("fp8", 256): 1.3}
LORA_TARGETS = {8: (0.08, 0.045), 32: (0.22, 0.179)}      # decode overhead target, the issue's floor
STAGE_OF = {"env": "env", "tests": "tests", "kernels": "kernels", "quant": "quant", "roofline_bf16": "roofline",
            "roofline_fp8": "roofline", "lora": "lora", "lora_fused": "lora_fused", "host": "host", "spec_verify": "spec",
            "spec_ngram": "spec",
            "offline": "offline", "serving": "serving", "serving_eager": "serving_eager",
            "serving_fused": "serving_fused", "many": "many"}


class Run:
    """The stage results of one run, and how to word a figure that is not there (pending, failed, dry run)."""

    def __init__(self, results: Path, dry: bool) -> None:
        self.dir, self.dry = results / STAGE_DIR, dry

    def status(self, stage: str) -> str:
        path = self.dir / f"{stage}.stage.json"
        return json.loads(path.read_text())["status"] if path.exists() else "pending"

    def data(self, name: str) -> dict[str, Any] | None:
        """The result `name`, also when a later part of its stage failed (gpu_run.py deletes a stage's results
        before it runs it, so a file here is always from the stage's last attempt)."""
        path = self.dir / f"{name}.json"
        if self.status(STAGE_OF[name]) == "pending" or not path.exists():
            return None
        return json.loads(path.read_text())

    def missing(self, name: str) -> str:
        stage = STAGE_OF[name]
        status = self.status(stage)
        if status == "pending":
            return f"not measured yet (stage {stage})"
        return f"stage {stage} {status}: see {STAGE_DIR}/{stage}.log"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms" if seconds is not None and math.isfinite(seconds) else "n/a"


class Table:
    def __init__(self, run: Run) -> None:
        self.run, self.rows = run, []

    def add(self, section: str, figure: str, name: str, measure: Callable[[dict], tuple[str, bool | None]],
            target: str = "-", floor: Callable[[dict], str] | str = "-") -> None:
        """One row; `measure(data)` -> (the figure as text, target met or None). In the dry run the row is computed
        (the parsing runs) and its figure replaced."""
        data = self.run.data(name)
        if data is None:
            text, met, floor_text = self.run.missing(name), None, floor if isinstance(floor, str) else "-"
        else:
            try:
                text, met = measure(data)
                floor_text = floor(data) if callable(floor) else floor
            except (KeyError, IndexError, TypeError, ZeroDivisionError, StopIteration) as exc:
                text, met, floor_text = f"unreadable result ({type(exc).__name__}: {exc})", False, "-"
                self.rows.append({"section": section, "figure": figure, "measured": text, "target": target,
                                  "floor": floor_text, "met": met})
                return
            computed = {"measured": text, "floor": floor_text}       # the dry run keeps what it parsed, aside
            if self.run.dry:
                text, met = DRY, None
                floor_text = DRY if callable(floor) else floor_text
            self.rows.append({"section": section, "figure": figure, "measured": text, "target": target,
                              "floor": floor_text, "met": met, **({"dry_run_parsed": computed} if self.run.dry else {})})
            return
        self.rows.append({"section": section, "figure": figure, "measured": text, "target": target,
                          "floor": floor_text, "met": met})


    def add_parsed(self, section: str, figure: str, text: str) -> None:
        """A row per item of a result that `add` does not name in advance (the sweep's shapes, a trace's
        workloads): informative, no target; in the dry run its figure is replaced as in `add`."""
        row = {"section": section, "figure": figure, "measured": text, "target": "-", "floor": "-", "met": None}
        if self.run.dry:
            row.update(measured=DRY, dry_run_parsed={"measured": text, "floor": "-"})
        self.rows.append(row)


def host_rows(table: Table) -> None:
    """The host stage (host_profile.py): an eager step with a long chunk beside decode rows, base against the mix,
    where its host time goes. Diagnostic rows: no target."""
    def shape(d: dict) -> str:
        return f"{d['chunk']}-token chunk, {d['num_decoding']} decode rows"

    table.add("host", "host time of an eager step with prefill (host stage): base / mix", "host", lambda d: (
        f"{d['base']['host_ms_median']:.1f} / {d['mix']['host_ms_median']:.1f} ms; the step "
        f"{d['base']['measured_ms_median']:.1f} / {d['mix']['measured_ms_median']:.1f} ms ({shape(d)})", None))
    table.add("host", "device waits inside it (host stage, sync debug mode): base / mix", "host", lambda d: (
        f"{d['base']['syncs_per_step']:.2f} / {d['mix']['syncs_per_step']:.2f} a step; mix: "
        + ("; ".join(f"{site} x{n}" for site, n in list(d["mix"]["sync_sites"].items())[:3]) or "none"), None))
    table.add("host", "host time of that step with the device drained before it (host stage): base / mix", "host",
              lambda d: (f"{d['base']['drained_host_ms_median']:.1f} / {d['mix']['drained_host_ms_median']:.1f} ms"
                         if "drained_host_ms_median" in d["base"] else "not measured (an older host_profile.py)",
                         None))
    table.add("host", "mix: event waits inside the chunk's step (host stage, cProfile, by caller)", "host", lambda d: (
        ("; ".join(f"{w['caller']} x{w['calls_per_step']:g} {w['ms_per_step']:.2f} ms" for w in d["mix"]["waits"][:3])
         or "none") if "waits" in d["mix"] else "not measured (an older host_profile.py)", None))
    table.add("host", "caching allocator retries in it (host stage): base / mix", "host", lambda d: (
        f"{d['base']['alloc_retries']} / {d['mix']['alloc_retries']}", None))
    table.add("host", "mix: functions by own host time (host stage, cProfile, ms a step)", "host", lambda d: (
        ", ".join(f"{p['function']} {p['own_ms_per_step']:.2f}" for p in d["mix"]["profile"][:6]), None))


def sweep_rows(run: Run, table: Table) -> None:
    """Per shape of the kernels stage's BGMV config sweep: the latency model's choice against the fastest config
    swept (adapters/lora_ops/bgmv.py fits its model to these rows)."""
    data = run.data("kernels")
    shapes: dict[tuple, list[dict]] = {}
    for r in (data or {}).get("sweep", []) + (data or {}).get("mixed_sweep", []):
        shapes.setdefault((r["linear"], r.get("rank", 16), r["slots"], r["rows"], r.get("live", r["slots"]),
                           r.get("chunk")), []).append(r)

    def config(r: dict) -> str:
        wide = (r.get("block_k", 64), r.get("block_n", 64)) != (64, 64)
        launch = [f"{r[k]} {w}" for k, w in (("num_warps", "warps"), ("num_stages", "stages")) if r.get(k)]
        return f"{r['splits']} x {r['chunks']}" + (f" (tiles {r['block_k']} x {r['block_n']})" if wide else "") + \
            (f" ({', '.join(launch)})" if launch else "")

    for (linear, rank, slots, rows, live, chunk), rs in shapes.items():
        best = min(rs, key=lambda r: r["ms"])
        chosen = [r for r in rs if r.get("chosen")]
        text = f"fastest {config(best)}: {1e3 * best['ms']:.1f} us"
        if chosen:
            text = f"choice {config(chosen[0])}: {1e3 * chosen[0]['ms']:.1f} us ({chosen[0]['ms'] / best['ms']:.2f}x " \
                   f"the {text})"
        on = f" on {live}" if live != slots else ""
        shape = f"{slots} slots x {rows} rows{on}" if chunk is None else \
            f"a mixed step of {rows} rows ({chunk}-token chunk, decode rows over {slots - 1} other slots)"
        table.add_parsed("kernels", f"BGMV launch config, {linear} r{rank}, {shape}: the "
                                    f"model's choice (K splits x column chunks) vs the sweep's fastest", text)


def serving_labels(data: dict) -> list[str]:
    """The serving stage's workloads in the order they ran: every rate, the mix then the base at each."""
    points = data["workloads"]
    labels = []
    for i in range(max((len(p) for p in points.values()), default=0)):
        for workload, pts in points.items():
            if i < len(pts):
                rate = pts[i]["rate"]
                labels.append(f"{workload} @ {'inf' if math.isinf(rate) else f'{rate:.3g}'} req/s")
    return labels


def trace_rows(run: Run, table: Table) -> None:
    """Each serving stage's step trace read workload by workload (benchmarks/step_trace_summary.py): which steps
    make the inter-token tail and why they ran past their budget."""
    for stage in ("serving", "serving_eager", "serving_fused"):
        data, path = run.data(stage), run.dir / f"{stage}.steps.jsonl"
        if data is None or not path.exists():
            continue
        read = [w for w in traces.windows(traces.load(path)) if len(w) >= traces.MIN_STEPS]
        labels = serving_labels(data)
        if len(labels) != len(read):                 # a workload too short to read, or two run without a pause
            labels = [f"window {i}" for i in range(len(read))]
        for label, window in zip(labels, read):
            text = traces.row(label, traces.read_window(window))[1]
            table.add_parsed("serving", f"{stage} step trace: {label}", text)


def build(run: Run, table: Table) -> None:
    add = table.add
    add("tests", "GPU tests (pytest -m gpu)", "tests", lambda d: (
        f"{d['passed']} passed, {d['failed']} failed, {d['errors']} errors, {d['skipped']} skipped"
        if not d["timed_out"] else "timed out", not d["timed_out"] and d["failed"] == 0 and d["errors"] == 0),
        "all pass")
    roof = run.data("roofline_bf16") or {}
    batches = [p["batch"] for p in roof.get("points", [])] or [1, 8, 64, 128, 256]
    for b in batches:
        def point(d: dict, b: int = b) -> dict:
            return next(p for p in d["points"] if p["batch"] == b)
        add("decode", f"decode step, batch {b}, bf16", "roofline_bf16", lambda d, b=b: (
            f"{ms(point(d, b)['step_s'])} step, {ms(point(d, b)['forward_s'])} forward, "
            f"{point(d, b)['tok_s']:.0f} tok/s = {point(d, b)['step_over_roofline']:.2f}x floor",
            point(d, b)["step_over_roofline"] <= 1.10 if b == 1 else None),
            "step <= 1.10x floor (issue 13)" if b == 1 else "-",
            lambda d, b=b: f"{ms(point(d, b)['roofline_s'])}: (weights + KV of each context) / read bandwidth")
    fp8 = run.data("roofline_fp8") or {}
    for b in [p["batch"] for p in fp8.get("points", [])] or [1, 64]:
        def pair(d: dict, b: int = b) -> tuple[dict, dict]:
            bf = run.data("roofline_bf16")
            return (next(p for p in d["points"] if p["batch"] == b),
                    next(p for p in bf["points"] if p["batch"] == b))
        add("decode", f"FP8 decode step, batch {b} (online FP8 weights)", "roofline_fp8", lambda d, b=b: (
            f"{ms(pair(d, b)[0]['step_s'])} = {pair(d, b)[1]['step_s'] / pair(d, b)[0]['step_s']:.2f}x bf16",
            pair(d, b)[1]["step_s"] / pair(d, b)[0]["step_s"] >= 1.2), ">= 1.2x bf16",
            lambda d, b=b: f"{ms(pair(d, b)[0]['roofline_s'])} (= {pair(d, b)[1]['roofline_s'] / pair(d, b)[0]['roofline_s']:.2f}x "
                           "bf16 by bytes)")
    lora = run.data("lora") or {}
    for k in sorted(int(key[1:]) for key in lora if key[0] == "k" and key[1:].isdigit()) or sorted(LORA_TARGETS):
        target, issue_floor = LORA_TARGETS.get(k, (None, None))
        add("LoRA", f"LoRA decode-step overhead, {k} adapters (every row on its own adapter)", "lora",
            lambda d, k=k, t=target: (f"{100 * d[f'k{k}']['decode_overhead']:+.1f}% (LoRA / base step "
                                      f"{1 + d[f'k{k}']['decode_overhead']:.3f}x; "
                                      f"{d[f'k{k}']['decode_overhead'] / d[f'k{k}']['decode_floor']:.2f}x the floor's "
                                      "overhead here)", None if t is None else d[f"k{k}"]["decode_overhead"] <= t),
            f"<= +{100 * target:.0f}%" if target else "-", lambda d, k=k, f=issue_floor: (
                (f"+{100 * f:.1f}% (issue); " if f else "") + f"+{100 * d[f'k{k}']['decode_floor']:.1f}% here: A+B "
                "bytes of the adapters / step bytes"))
        add("LoRA", f"LoRA prefill overhead, {k} adapters", "lora", lambda d, k=k: (
            f"{100 * d[f'k{k}']['prefill_overhead']:+.1f}% ({d['num_requests']} prompts of "
            f"{d[f'k{k}'].get('prefill_prompt_len', d['prompt_len'])} tokens)", d[f"k{k}"]["prefill_overhead"] <= 0.12),
            "<= +12%", lambda d, k=k: f"+{100 * d[f'k{k}']['prefill_floor']:.1f}%: LoRA FLOPs / base linear FLOPs")
        add("LoRA", f"kernel compiles after the warm-up (LoRA stage, {k} adapters)", "lora", lambda d, k=k: (
            str(d[f"k{k}"]["compiles_after_warmup"]), d[f"k{k}"]["compiles_after_warmup"] == 0), "0")
        add("LoRA", f"LoRA generate overhead, {k} adapters", "lora", lambda d, k=k: (
            f"{100 * d[f'k{k}']['overhead']:+.1f}% (r{d['rank']}, {d['targets']} modules, {d['num_requests']} requests "
            f"of {d['prompt_len']} + {d['max_tokens']} tokens)", None))
    after = run.data("lora_fused") or {}
    for k in sorted(int(key[1:]) for key in after if key[0] == "k" and key[1:].isdigit()) or sorted(LORA_TARGETS):
        def beside(k: int = k) -> str:
            d = run.data("lora")
            if not d or f"k{k}" not in d or "decode_overhead" not in d[f"k{k}"]:
                return "the lora stage's decode row: not measured"
            return f"lora stage (beside them) {100 * d[f'k{k}']['decode_overhead']:+.1f}%"
        add("LoRA", f"LoRA decode-step overhead after the base GEMMs (LORAPLEX_LORA_OVERLAP=0), {k} adapters",
            "lora_fused", lambda d, k=k: (
                f"{100 * d[f'k{k}']['decode_overhead']:+.1f}% ({1e3 * d[f'k{k}']['decode_step_lora_s']:.2f} / "
                f"{1e3 * d[f'k{k}']['decode_step_base_s']:.2f} ms); {beside(k)}",
                None if LORA_TARGETS.get(k) is None else d[f"k{k}"]["decode_overhead"] <= LORA_TARGETS[k][0]),
            f"<= +{100 * LORA_TARGETS[k][0]:.0f}%" if k in LORA_TARGETS else "-")
        add("LoRA", f"kernel compiles after the warm-up (lora_fused stage, {k} adapters)", "lora_fused",
            lambda d, k=k: (str(d[f"k{k}"]["compiles_after_warmup"]), d[f"k{k}"]["compiles_after_warmup"] == 0), "0")
    host_rows(table)
    kernels = run.data("kernels") or {}
    for i, name in enumerate([r["name"] for r in kernels.get("rows", [])] or kernel_names(run.dry)):
        add("kernels", name, "kernels", lambda d, i=i: (
            f"{1e3 * d['rows'][i]['ms']:.1f} us = {d['rows'][i]['over_floor']:.2f}x floor"
            f"{' (graph)' if d['rows'][i].get('graph_ms') is not None else ''}, rel err "
            f"{d['rows'][i]['rel_err']:.1e}", d["rows"][i]["rel_err"] <= 2e-2), "correct; near its floor",
            lambda d, i=i: f"{1e3 * d['rows'][i]['floor_ms']:.1f} us ({d['rows'][i]['bound']})")
    sweep_rows(run, table)
    quant = run.data("quant") or {}
    keys = [(r["format"], r["tokens"]) for r in quant.get("rows", [])] or \
        [(f, t) for f in QUANT_FORMATS for t in QUANT_TOKENS[run.dry]]
    for fmt, t in keys:
        def qrow(d: dict, fmt: str = fmt, t: int = t) -> dict:
            return next(r for r in d["rows"] if r["format"] == fmt and r["tokens"] == t)
        goal = QUANT_TARGETS.get((fmt, t))
        # a target holds for every shape (issue 35): judged on the worst shape's ratio, shown beside the sum's
        add("quantized linears", f"{fmt.upper()} linears of a layer, T={t}", "quant",
            lambda d, fmt=fmt, t=t, g=goal: (
                qrow(d, fmt, t)["note"] if qrow(d, fmt, t)["ms"] is None else
                f"{1e3 * qrow(d, fmt, t)['ms']:.1f} us = {qrow(d, fmt, t)['speedup_vs_bf16']:.2f}x bf16 cuBLAS; worst "
                f"shape {qrow(d, fmt, t).get('worst_layer')} {qrow(d, fmt, t).get('worst_speedup_vs_bf16', 0):.2f}x",
                None if g is None or qrow(d, fmt, t)["ms"] is None else
                qrow(d, fmt, t).get("worst_speedup_vs_bf16", 0) >= g),
            f">= {goal}x bf16, every shape" if goal else "-", lambda d, fmt=fmt, t=t: "-" if qrow(d, fmt, t)["ms"] is None else
            f"{1e3 * qrow(d, fmt, t)['floor_ms']:.1f} us ({qrow(d, fmt, t)['over_floor']:.2f}x): packed bytes, FLOPs")
    fp8_part_rows(run, table, quant)
    verify = run.data("spec_verify") or {}
    for b in [r["batch"] for r in verify.get("rows", [])] or [1, 8, 32, 64]:
        def vrow(d: dict, b: int = b) -> dict:
            return next(r for r in d["rows"] if r["batch"] == b)
        add("speculative", f"verification step / decode step, batch {b} (k 4)", "spec_verify", lambda d, b=b: (
            f"{vrow(d, b)['verify_over_decode']:.2f}x ("
            f"{ms(vrow(d, b).get('verify_graph_s', vrow(d, b)['verify_eager_s']))} "
            f"{'graph' if 'verify_graph_s' in vrow(d, b) else 'eager'} vs "
            f"{ms(vrow(d, b).get('decode_graph_s', vrow(d, b)['decode_eager_s']))})",
            vrow(d, b)["verify_over_decode"] <= 1.3 and "verify_graph_s" in vrow(d, b) if b <= 32 else None),
            "<= 1.3x, both graph-replayed" if b <= 32 else "-", "1.00x: the same weights and KV are read")
    add("speculative", "n-gram speculation, batch 1 (k 4)", "spec_ngram", lambda d: (
        f"{d['speedup']:.2f}x tok/s, acceptance {d['acceptance_rate']:.2f}, mean accepted length "
        f"{d['mean_accepted_length']:.2f}" + (" (random weights)" if d["random_weights"] else ""), d["speedup"] >= 1.5),
        ">= 1.5x tok/s", lambda d: f"break-even mean accepted length {_verify_b1(run)}")
    ngram = run.data("spec_ngram") or {}
    for b in [r["batch"] for r in ngram.get("rows", []) if r["batch"] > 1] or [32]:
        def nrow(d: dict, b: int = b) -> dict:
            return next(r for r in d["rows"] if r["batch"] == b)
        add("speculative", f"n-gram speculation, batch {b}, disable_by_batch_size (k 4)", "spec_ngram",
            lambda d, b=b: (f"{nrow(d, b)['speedup']:.2f}x tok/s (disable_by_batch_size "
                            f"{d.get('disable_by_batch_size')}), acceptance {nrow(d, b)['acceptance_rate']:.2f}",
                            nrow(d, b)["speedup"] >= 0.97 if b >= 32 else None),
            ">= 0.97x tok/s" if b >= 32 else "-", "1.00x: speculation off")
    add("offline", "offline throughput vs HF generate", "offline", lambda d: (
        f"{d['speedup_vs_hf']:.1f}x ({d['loraplex_out_tok_s']:.0f} vs {d['hf_out_tok_s']:.0f} tok/s; "
        f"{d['num_requests']} requests, HF static batch {d['hf_batch_size']})",
        d["speedup_vs_hf"] >= 15), ">= 15x (issue 13)")
    serving_rows(run, table)
    trace_rows(run, table)


def fp8_part_rows(run: Run, table: Table, quant: dict) -> None:
    """What the FP8 layer spends beside the raw GEMM (issue 35): its activation quantization kernel, the torch ops
    it replaced, `_scaled_mm` alone; no target of its own (the FP8 rows above carry the targets)."""
    def text(d: dict, t: int) -> tuple[str, bool | None]:
        r = next((r for r in d.get("fp8_parts", []) if r["tokens"] == t), None)
        if r is None:
            return "not run (FP8 tensor cores needed)", None
        return (f"quantization {1e3 * r['quant_ms']:.1f} us (torch ops: {1e3 * r['quant_torch_ms']:.1f} us) + "
                f"_scaled_mm {1e3 * r['scaled_mm_ms']:.1f} us; kernel bitwise = emulation: {r['exact']}",
                False if not r["exact"] else None)
    for t in [r["tokens"] for r in quant.get("fp8_parts", [])] or list(QUANT_TOKENS[run.dry]):
        table.add("quantized linears", f"FP8 parts of a layer, T={t}", "quant", lambda d, t=t: text(d, t), "-",
                  lambda d, t=t: next((f"{1e3 * r['quant_floor_ms']:.2f} us: x read + codes and scales written"
                                       for r in d.get("fp8_parts", []) if r["tokens"] == t), "-"))


def _verify_b1(run: Run) -> str:
    d = run.data("spec_verify")
    row = next((r for r in (d or {}).get("rows", []) if r["batch"] == 1), None)
    return f"{row['verify_over_decode']:.2f} (verify / decode at batch 1)" if row else "n/a (spec_verify missing)"


def saturation_rate(points: list[dict]) -> float | None:
    """The lowest finite offered rate the server could not keep up with (achieved < 90% of offered)."""
    for p in sorted((p for p in points if math.isfinite(p["rate"])), key=lambda p: p["rate"]):
        if p["request_s"] < 0.9 * p["rate"]:
            return p["rate"]
    return None


def graphs_ab(run: Run, eager: dict, workload: str) -> tuple[str, None]:
    """The serving stage (mixed-step graphs on) over serving_eager (off) at the 0.5x point of `workload`."""
    on = run.data("serving")
    if on is None:
        return "the serving stage is needed", None
    return serving_ab(on, eager, workload)


def overlap_ab(run: Run, off: dict, workload: str) -> tuple[str, None]:
    """The serving stage (the LoRA beside the base GEMMs, the default) over serving_fused (after them) at the 0.5x
    point of `workload`."""
    on = run.data("serving")
    if on is None:
        return "the serving stage is needed", None
    return serving_ab(on, off, workload)


def serving_ab(a: dict, b: dict, workload: str) -> tuple[str, None]:
    """Serving run `a` over run `b` at the 0.5x point of `workload`: ITL p99, TTFT p99 and output tokens/s."""
    pick = [next(p for p in d["workloads"][workload] if p.get("rate_fraction") == 0.5) for d in (a, b)]
    ratio = [a / b for a, b in zip((pick[0]["itl_p99_s"], pick[0]["ttft_p99_s"], pick[0]["output_tok_s"]),
                                   (pick[1]["itl_p99_s"], pick[1]["ttft_p99_s"], pick[1]["output_tok_s"]))]
    return (f"ITL p99 {1e3 * pick[0]['itl_p99_s']:.1f} / {1e3 * pick[1]['itl_p99_s']:.1f} ms ({ratio[0]:.2f}x), "
            f"TTFT p99 {1e3 * pick[0]['ttft_p99_s']:.0f} / {1e3 * pick[1]['ttft_p99_s']:.0f} ms ({ratio[1]:.2f}x), "
            f"{ratio[2]:.2f}x tok/s", None)


def serving_rows(run: Run, table: Table) -> None:
    add = table.add
    serving = run.data("serving") or {}
    workloads = serving.get("workloads") or {"mix": [], "base": []}

    def floors(d: dict, w: str, i: int) -> str:
        roof, env = run.data("roofline_bf16"), run.data("env")
        if roof is None or env is None:
            return "decode step roofline (stage roofline) and ceilings (stage env) needed"
        step = next(p for p in roof["points"] if p["batch"] == 1)["roofline_s"]
        prompt = d["workloads"][w][i]["prompt_tokens_mean"]
        params = roof["weight_bytes"] / (4 if roof["dtype"] == "float32" else 2)
        prefill = 2 * params * prompt / (1e12 * env["matmul_tflops"])
        return f"ITL >= {ms(step)} (batch-1 step); TTFT >= {ms(max(step, prefill))} (mean prompt {prompt:.0f} tokens)"

    for w, points in workloads.items():
        for i, p in enumerate(points or [{"rate": math.inf}, *({"rate": 0.0, "rate_fraction": f} for f in (0.5, 0.8))]):
            def measure(d: dict, w: str = w, i: int = i) -> tuple[str, bool | None]:
                q = d["workloads"][w][i]
                sat = saturation_rate(d["workloads"][w])
                below = q["rate_fraction"] < 1 if "rate_fraction" in q else \
                    math.isfinite(q["rate"]) and (sat is None or q["rate"] < sat)
                ok = q["ttft_p99_s"] <= 0.5 and q["itl_p99_s"] <= 2 * q["itl_p50_s"] if below else None
                offered = f"offered {q['rate']:.2f} req/s: " if "rate_fraction" in q else ""
                return (f"{offered}TTFT p50/p99 {1e3 * q['ttft_p50_s']:.0f}/{1e3 * q['ttft_p99_s']:.0f} ms, ITL p50/p99 "
                        f"{1e3 * q['itl_p50_s']:.1f}/{1e3 * q['itl_p99_s']:.1f} ms, E2E p99 {1e3 * q['e2e_p99_s']:.0f} "
                        f"ms, goodput {q['goodput_request_s']:.2f} req/s ({100 * q['goodput_share']:.0f}%), "
                        f"{q['output_tok_s']:.0f} tok/s, {q['request_s']:.2f} req/s", ok)
            finite = math.isfinite(p["rate"])
            label = f"{p['rate_fraction']:g}x saturation" if "rate_fraction" in p else f"{p['rate']:g} req/s"
            add("serving", f"serving {w} @ {label}", "serving", measure,
                "below saturation: TTFT p99 <= 500 ms, ITL p99 <= 2x p50" if finite else "- (saturation)",
                lambda d, w=w, i=i: floors(d, w, i))
    for w in ("mix", "base"):
        add("serving", f"mixed-step graphs on / off, {w}: ITL p99, TTFT p99 and tok/s at 0.5x saturation",
            "serving_eager", lambda d, w=w: graphs_ab(run, d, w),
            "- (on: the serving rows above)")
        add("serving", f"LoRA beside the base GEMMs on / off, {w}: ITL p99, TTFT p99 and tok/s at 0.5x saturation",
            "serving_fused", lambda d, w=w: overlap_ab(run, d, w),
            "- (on: the serving rows above)")
    add("serving", "serving saturation: mix / base req/s (rate inf)", "serving", lambda d: (
        (f"{d['saturation']['mix_over_base']:.2f}x", d["saturation"]["mix_over_base"] >= 0.85)
        if d["saturation"]["mix_over_base"] else (f"rate inf not measured for both (skipped: {d['skipped']})", None)),
        ">= 0.85x")
    add("serving", "serving: step-time model error (--max-step-ms auto)", "serving", lambda d: (
        "not exported" if d.get("step_time_prediction_error_ratio") is None else
        f"{d['step_time_prediction_error_ratio']:.2f} mean |predicted - measured| / measured step time", None),
        "- (the ITL rows above are the budget's target)")
    add("serving", "serving errors", "serving", lambda d: (
        str(sum(p["num_errors"] for pts in d["workloads"].values() for p in pts)),
        all(p["num_errors"] == 0 for pts in d["workloads"].values() for p in pts)), "0")
    add("serving", "kernel compiles after the warm-up (serving)", "serving", lambda d: (
        str(d["compiles_after_warmup"]), d["compiles_after_warmup"] == 0), "0")
    add("serving", "kernel compiles after the warm-up (speculative verification)", "spec_verify", lambda d: (
        str(d["compiles_after_warmup"]), d["compiles_after_warmup"] == 0), "0")
    add("adapters", "many adapters: output tok/s, 1000 adapters / 32 (Zipf 1.0)", "many", lambda d: (
        f"{d['throughput_ratio']:.2f}x ({d['phases'][1]['output_tok_s']:.0f} / {d['phases'][0]['output_tok_s']:.0f} "
        f"tok/s, {d['phases'][1]['num_errors'] + d['phases'][0]['num_errors']} errors)", d["meets"]["throughput"]),
        ">= 0.8x (S-LoRA: 0.95x)")
    add("adapters", "many adapters: host-to-device copies/s, adapter reads/s", "many", lambda d: (
        f"{d['phases'][1]['device_loads_per_s']:.1f}, {d['phases'][1]['adapter_reads_per_s']:.1f}", None))
    add("adapters", "many adapters: TTFT p99, cold requests / all (1000 adapters)", "many", lambda d: (
        f"{ms(d['phases'][1]['cold_ttft_p99_s'])} / {ms(d['phases'][1]['ttft_p99_s'])} "
        f"({d['phases'][1]['num_cold_requests']} cold)", None))
    add("adapters", "many adapters: worst gap between streamed tokens, 1000 / 32", "many", lambda d: (
        f"{d['gap_max_ratio']:.2f}x", d["meets"]["loads_overlap"]), "<= 2x (loads overlap compute)")
    add("adapters", "many adapters: adapters in host memory (peak), server RSS growth", "many", lambda d: (
        f"{d['phases'][1]['peak_host_adapters']:.0f} <= {d['args']['max_cpu_loras']}, "
        f"+{d['rss_growth_bytes'] / 2**20:.0f} MiB (bound {d['host_bytes_bound'] / 2**20:.0f} MiB)",
        d["meets"]["host_adapters"]), "<= --max-cpu-loras")
    add("adapters", "many adapters: failed requests (all phases)", "many", lambda d: (
        str(sum(p["num_errors"] for p in d["phases"])), all(p["num_errors"] == 0 for p in d["phases"])), "0")


def header(run: Run) -> list[str]:
    env = run.data("env")
    if env is None:
        return [f"environment: {run.missing('env')}"]
    lines = [f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, driver {env['driver']}, "
             f"GPU {env['gpu_name'] or env['gpu'] or 'none (CPU)'}",
             f"read bandwidth {env['read_bandwidth_gb_s']:.0f} GB/s, copy {env['copy_bandwidth_gb_s']:.0f} GB/s, "
             f"bf16 matrix rate {env['matmul_tflops']:.1f} TFLOP/s (measured; the floors divide by these)"]
    if run.dry:
        lines.append("DRY RUN on the CPU (tiny model and shapes): no figure below is a GPU figure")
    return lines


def render(title: str, head: list[str], rows: list[dict], stages: dict[str, str]) -> str:
    mark = {True: "yes", False: "**no**", None: "-"}
    lines = [f"# {title}", ""] + [f"- {h}" for h in head] + \
        ["- stages: " + ", ".join(f"{k} {v}" for k, v in stages.items()), "",
         "| section | figure | measured | target | floor | met |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['figure']} | {r['measured']} | {r['target']} | {r['floor']} | {mark[r['met']]} |"
              for r in rows]
    missed = [r["figure"] for r in rows if r["met"] is False]
    lines += ["", f"targets missed: {', '.join(missed) if missed else 'none'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--results", type=Path, default=None, help="default: $LORAPLEX_BENCH_RESULTS or benchmarks/results")
    args = ap.parse_args(argv)
    results = args.results or Path(os.environ.get("LORAPLEX_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
    run = Run(results, args.dry_run)
    table = Table(run)
    build(run, table)
    date = datetime.date.today().isoformat()
    stages = {s.name: run.status(s.name) for s in STAGES}
    head = header(run)
    name = f"gpu_{date}" + ("_dry" if args.dry_run else "")
    data = {"date": date, "dry_run": args.dry_run, "environment": run.data("env"), "stages": stages, "header": head,
            "rows": table.rows, "targets_missed": [r["figure"] for r in table.rows if r["met"] is False]}
    (results / f"{name}.json").write_text(json.dumps(data, indent=2))
    text = render(f"GPU run {date}" + (" (dry run)" if args.dry_run else ""), head, table.rows, stages)
    (results / f"{name}.md").write_text(text)
    (results / STAGE_DIR / "summary.md").write_text(text)
    print(f"wrote {results / name}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
