"""Configuration in one place (issue 32): every environment variable the product reads is declared in
core/environment/variables.py (type, default, meaning), read there and nowhere else, read once, and documented in
docs/environment.md; a bad value is named, and `loraplex serve` refuses it before it starts anything. grammar/ and
adapters/ take what the environment says from their callers: they never import core (nor gateway)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from core.environment import variables
from core.environment.variables import ALL, FUSED_OPS, GRAMMAR_WORKER_MEMORY_MB, EnvVar, check_all
from envlib import setenv

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("core", "adapters", "grammar", "gateway")
THE_MODULE = ROOT / "core" / "environment" / "variables.py"
DOCS = ROOT / "docs" / "environment.md"
NAME = re.compile(r"\bLORAPLEX_[A-Z0-9_]*[A-Z0-9]\b")
ENV_APIS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def product_files() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (ROOT / package).rglob("*.py"))


def environment_reads(path: Path) -> list[str]:
    """`os.environ` / `os.getenv` (and the like) anywhere in `path`, as file:line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ENV_APIS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(alias.name in ENV_APIS for alias in node.names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from os import ...")
    return found


def imported_packages(path: Path) -> list[tuple[str, int]]:
    """The top-level package of every import statement in `path` (module level or in a function), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name.partition(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.partition(".")[0], node.lineno))
    return found


def names_in(paths: list[Path]) -> set[str]:
    return {name for p in paths for name in NAME.findall(p.read_text())}


def test_only_the_one_module_reads_the_environment() -> None:
    reads = [r for p in product_files() if p != THE_MODULE for r in environment_reads(p)]
    assert not reads, "the environment is read outside core/environment/variables.py (declare the variable there):\n" \
                      + "\n".join(reads)
    assert environment_reads(THE_MODULE), "the scan finds nothing, even where the environment is read"


def test_the_product_has_exactly_its_four_packages() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == set(PRODUCT), "the top level is core/, adapters/, grammar/ and gateway/ (and no other package)"


@pytest.mark.parametrize("lower, upper", [("grammar", ("core", "gateway")), ("adapters", ("core", "gateway")),
                                          ("core", ("gateway",))])
def test_imports_flow_down(lower: str, upper: tuple[str, ...]) -> None:
    """gateway -> core -> grammar / adapters, never back up: what the environment says reaches grammar and adapters
    as arguments (the LoRA and bitmask paths, the compile limits), never through an import of core."""
    files = sorted((ROOT / lower).rglob("*.py"))
    assert files
    up = [f"{p.relative_to(ROOT)}:{line}: imports {package}" for p in files
          for package, line in imported_packages(p) if package in upper]
    assert not up, "\n".join(up)
    assert any(package == lower for p in files for package, _ in imported_packages(p)), "the scan finds no import"


def test_every_variable_the_product_names_is_declared() -> None:
    declared = {var.name for var in ALL}
    assert len(declared) == len(ALL)
    named = names_in([p for p in product_files() if p != THE_MODULE])
    assert named - declared == set(), "named in the product but not declared in core/environment/variables.py"
    assert {v.name for v in ALL if v.name.startswith("LORAPLEX_")} <= names_in([THE_MODULE])


def test_every_variable_is_documented() -> None:
    """docs/environment.md: every declared variable with its type and default, and the variables the tests and
    benchmarks read (theirs, not the product's)."""
    text = DOCS.read_text().replace("\\|", "|")   # a pipe inside a table cell is escaped
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([A-Z0-9_]+)` \|.*$", text, re.MULTILINE)}
    for var in ALL:
        assert var.name in rows, f"{var.name} has no row in docs/environment.md"
        assert f"| `{var.kind}` | {var.default_text} |" in rows[var.name], rows[var.name]
    others = [p for folder in ("tests", "benchmarks", "scripts", "deploy", "deploy-tp")
              for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".sh", ".yaml")]
    missing = names_in(others) - names_in([DOCS])
    assert not missing, f"read by tests, benchmarks or scripts but not in docs/environment.md: {sorted(missing)}"
    assert "HF_HUB_OFFLINE" in text
    stale = names_in([DOCS]) - {v.name for v in ALL} - names_in(others)
    assert not stale, f"docs/environment.md names variables nothing reads: {sorted(stale)}"


def test_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_FUSED_OPS", "torch")
    assert FUSED_OPS.get() == "torch"
    monkeypatch.setenv("LORAPLEX_FUSED_OPS", "triton")
    assert FUSED_OPS.get() == "torch"          # a hot path never reads the environment again
    variables.reset()
    assert FUSED_OPS.get() == "triton"
    setenv(monkeypatch, "LORAPLEX_FUSED_OPS", " Auto ")
    assert FUSED_OPS.get() == "auto"


def test_is_set_tells_an_operator_s_choice_from_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """`is_set`: the environment names a value (the TP warning about LORAPLEX_LORA_OVERLAP only for an operator
    who asked for it; its default is on)."""
    monkeypatch.delenv("LORAPLEX_LORA_OVERLAP", raising=False)
    variables.reset()
    assert not variables.LORA_OVERLAP.is_set() and variables.LORA_OVERLAP.get() is True
    for raw, value in (("1", True), ("0", False)):
        setenv(monkeypatch, "LORAPLEX_LORA_OVERLAP", raw)
        assert variables.LORA_OVERLAP.is_set() and variables.LORA_OVERLAP.get() is value
    setenv(monkeypatch, "LORAPLEX_LORA_OVERLAP", "  ")
    assert not variables.LORA_OVERLAP.is_set()


def test_defaults_and_types() -> None:
    assert {var.name: var.read({}) for var in ALL} == {var.name: var.default for var in ALL}
    env = {"LORAPLEX_ASYNC_SCHEDULING": "0", "LORAPLEX_ENGINE_PROCESS": "off", "LORAPLEX_TP_STEP_TIMEOUT_S": "2.5",
           "LORAPLEX_GRAMMAR_WORKER_MEMORY_MB": "0", "LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN": "true",
           "LORAPLEX_KERNEL_SELFCHECK": "1", "LORAPLEX_ENGINE_TEST_HOOK": "engine_probe:f", "TRITON_INTERPRET": "1"}
    got = {var.name: var.read(env) for var in ALL if var.name in env}
    assert got == {"LORAPLEX_ASYNC_SCHEDULING": False, "LORAPLEX_ENGINE_PROCESS": False,
                   "LORAPLEX_TP_STEP_TIMEOUT_S": 2.5, "LORAPLEX_GRAMMAR_WORKER_MEMORY_MB": 0,
                   "LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN": True, "LORAPLEX_KERNEL_SELFCHECK": "1",
                   "LORAPLEX_ENGINE_TEST_HOOK": "engine_probe:f", "TRITON_INTERPRET": True}


@pytest.mark.parametrize("name, bad", [
    ("LORAPLEX_ATTENTION_BACKEND", "cuda"), ("LORAPLEX_QUANT_GEMM", "fast"), ("LORAPLEX_KERNEL_SELFCHECK", "yes"),
    ("LORAPLEX_ASYNC_SCHEDULING", "maybe"), ("LORAPLEX_ENGINE_PROCESS", "2"), ("LORAPLEX_TP_START_TIMEOUT_S", "-1"),
    ("LORAPLEX_TP_STEP_TIMEOUT_S", "soon"), ("LORAPLEX_GRAMMAR_WORKER_MEMORY_MB", "10"),
    ("LORAPLEX_ENGINE_TEST_HOOK", "no_function"),
])
def test_a_bad_value_is_named(name: str, bad: str) -> None:
    (var,) = [v for v in ALL if v.name == name]
    with pytest.raises(ValueError, match=f"^{name} ") as info:
        var.read({name: bad})
    assert bad in str(info.value)
    assert check_all({name: bad}) == [str(info.value)] and check_all({}) == []


def test_a_failed_read_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GRAMMAR_WORKER_MEMORY_MB.name, "lots")
    with pytest.raises(ValueError, match=GRAMMAR_WORKER_MEMORY_MB.name):
        GRAMMAR_WORKER_MEMORY_MB.get()
    monkeypatch.setenv(GRAMMAR_WORKER_MEMORY_MB.name, "512")
    assert GRAMMAR_WORKER_MEMORY_MB.get() == 512


def test_serve_refuses_a_bad_variable_before_it_starts(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import build_parser, config_from_args

    monkeypatch.setenv("LORAPLEX_FUSED_OPS", "fastest")
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        config_from_args(parser.parse_args(["serve", "--model", "/m"]), parser)
    assert info.value.code == 2 and "LORAPLEX_FUSED_OPS must be auto, torch or triton" in capsys.readouterr().err


def test_declarations_are_complete() -> None:
    for var in ALL:
        assert isinstance(var, EnvVar) and var.kind and var.default_text and len(var.doc) > 20, var
