"""Plants each bug of tests/mutations/catalogue.py in a temporary copy of the repository, runs the test files
that must catch it, and reports which tests did. Every planted bug must be caught: the exit status is 1 when
one survives (no test failed), an edit no longer applies, or (with --baseline) the files fail unmutated.

    python tests/mutations/mutation_check.py                    # every mutation (tens of minutes on 2 cores)
    python tests/mutations/mutation_check.py --list
    python tests/mutations/mutation_check.py lora-slot1-expand stop-string-kept --baseline
    python tests/mutations/mutation_check.py --json out.json    # mutation -> catching tests, machine-readable

The copy holds the files git tracks plus the untracked ones it does not ignore (the working tree as it is, not
the last commit), so it checks the tests you are writing. Run by hand, never inside the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from catalogue import MUTATIONS, Edit, Mutation  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULT_LINE = re.compile(r"^(FAILED|ERROR) (\S+)")


@dataclass
class Outcome:
    name: str
    caught_by: list[str] = field(default_factory=list)
    status: str = "survived"          # caught | survived | timeout | edit-failed
    seconds: float = 0.0
    detail: str = ""


def copy_repo(dest: Path) -> None:
    """The working tree's tracked and not-ignored untracked files (no .git, venvs or build outputs)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(root: Path, edits: tuple[Edit, ...]) -> dict[Path, str]:
    """Applies the edits; returns the original text of each touched file. Raises if an edit does not apply."""
    originals: dict[Path, str] = {}
    for edit in edits:
        path = root / edit.path
        text = path.read_text()
        originals.setdefault(path, text)
        count = text.count(edit.old)
        if count != 1:
            raise ValueError(f"{edit.path}: the text to replace occurs {count} times (expected once): {edit.old!r}")
        path.write_text(text.replace(edit.old, edit.new))
    return originals


def run_tests(root: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[list[str], str, bool]:
    """(failed or erroring test ids, the output's tail, timed out?) of one pytest run in `root`."""
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-rfE", "--tb=line",
           "-W", "ignore::DeprecationWarning"]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return [], out[-2000:], True
    failed = [m.group(2) for line in proc.stdout.splitlines() if (m := RESULT_LINE.match(line))]
    if proc.returncode not in (0, 1) and not failed:   # collection errors, usage errors: the run is the catch
        failed = [f"<pytest exit {proc.returncode}>"]
    return sorted(set(failed)), proc.stdout[-2000:], False


def check(mutation: Mutation, root: Path, timeout_s: float, baseline_failures: set[str]) -> Outcome:
    out = Outcome(mutation.name)
    start = time.monotonic()
    try:
        originals = apply(root, mutation.edits)
    except ValueError as exc:
        out.status, out.detail = "edit-failed", str(exc)
        return out
    try:
        failed, tail, timed_out = run_tests(root, mutation.tests, timeout_s)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    out.seconds = time.monotonic() - start
    out.caught_by = [t for t in failed if t not in baseline_failures]
    if timed_out:
        out.status, out.detail = "timeout", tail
    elif out.caught_by:
        out.status = "caught"
    else:
        out.detail = tail
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their test files")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the chosen mutations' test files unmutated; they must pass")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run (default 1800)")
    parser.add_argument("--json", type=Path, help="also write mutation -> catching tests here")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.description}\n    " + "\n    ".join(m.tests))
        return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="loraplex_mutants_") as tmp:
        root = Path(tmp) / "repo"
        copy_repo(root)
        baseline: set[str] = set()
        if args.baseline:
            files = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            failed, tail, timed_out = run_tests(root, files, args.timeout * 2)
            print(f"baseline ({len(files)} files): " + ("timed out" if timed_out else
                                                         f"{len(failed)} failing" if failed else "all pass"),
                  flush=True)
            if failed or timed_out:
                print("\n".join(f"  {t}" for t in failed) or tail)
                ok = False
                baseline = set(failed)
        outcomes = []
        for m in chosen:
            print(f"\n== {m.name}: {m.description}", flush=True)
            outcome = check(m, root, args.timeout, baseline)
            outcomes.append(outcome)
            print(f"   {outcome.status} ({outcome.seconds:.0f} s)" +
                  "".join(f"\n     {t}" for t in outcome.caught_by), flush=True)
            if outcome.status != "caught":
                ok = False
                print(outcome.detail)
    print("\nsummary (mutation -> number of catching tests):")
    for o in outcomes:
        print(f"  {o.name:36s} {o.status:11s} {len(o.caught_by):3d}")
    if args.json:
        args.json.write_text(json.dumps({o.name: {"status": o.status, "caught_by": o.caught_by,
                                                  "seconds": round(o.seconds)} for o in outcomes}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
