"""The test stage of gpu_run.py: the GPU-relevant test files (tests/helpers/gpu_test_files.py, marker `gpu`) under pytest
with the installed torch, their counts written as a result (passed, failed, errors, skipped, the failing ids).

`--dry-run` runs one test of one file of the list (`DRY_RUN_FILE`, `-k DRY_RUN_SELECT`) the same way, on the CPU.
Usage: python benchmarks/gpu_tests.py [--dry-run] [--timeout-s 480] [--workers 8] [--name gpu_tests]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, ROOT, write_results
from gpu_test_files import GPU_TEST_FILES

DRY_RUN_FILE = "tests/test_adapters/test_lora_bgmv.py"      # small and quick in the CPU interpreter
DRY_RUN_SELECT = "graph_buffers"                         # -k: one of its tests (under a second)


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    num = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": num["tests"] - num["failures"] - num["errors"] - num["skipped"], "failed": num["failures"],
            "errors": num["errors"], "skipped": num["skipped"], "failing": failing[:20]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dry-run", action="store_true", help=f"only {DRY_RUN_FILE} -k {DRY_RUN_SELECT}")
    ap.add_argument("--timeout-s", type=float, default=480.0)
    ap.add_argument("--name", default="gpu_tests")
    ap.add_argument("--workers", type=int, default=0,
                    help="pytest-xdist workers (-n; 0: one process). Triton compiles are CPU-bound and the device "
                         "machine has 16 cores, so 8 workers share the GPU and cut the stage to a fraction")
    args = ap.parse_args(argv)
    assert DRY_RUN_FILE in GPU_TEST_FILES
    files = [DRY_RUN_FILE] if args.dry_run else list(GPU_TEST_FILES)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files]
    if args.dry_run:
        cmd += ["-k", DRY_RUN_SELECT]
    if args.workers > 0:
        cmd += ["-n", str(args.workers), "-v"]      # -v: one PASSED/FAILED line per test, kept if the stage times out
    counts = None
    with tempfile.TemporaryDirectory(prefix="loraplex_gpu_tests_") as tmp:   # removed on any way out, Ctrl-C too
        xml = Path(tmp) / "junit.xml"
        try:
            proc = subprocess.run([*cmd, f"--junitxml={xml}"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.timeout_s)
            out, timed_out = proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as exc:
            out, timed_out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                else (exc.stdout or ""), True
        if xml.exists() and not timed_out:
            counts = junit_counts(xml)
    print(out[-3000:])
    log = RESULTS / f"{args.name}.pytest.log"           # the whole output: which tests ran, even after a timeout
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(out)
    data: dict = {"files": files, "dry_run": args.dry_run, "timed_out": timed_out, "tail": out[-2000:]}
    if counts is not None:
        data.update(counts)
        table = [("GPU tests", f"{data['passed']} passed, {data['failed']} failed, {data['errors']} errors, "
                               f"{data['skipped']} skipped"), ("failing", ", ".join(data["failing"]) or "none")]
    else:
        table = [("GPU tests", f"did not finish in {args.timeout_s:.0f} s" if timed_out else "pytest wrote no report")]
    write_results(args.name, data, table)


if __name__ == "__main__":
    main()
