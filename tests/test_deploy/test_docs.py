"""The docs hold together: every relative link of the repository's markdown resolves (file, and `#anchor` by
GitHub's rules), every repository path a page cites in backticks exists, every `loraplex serve` flag is on
docs/cli.md, every exported metric on docs/deployment.md, and the contract names of DESIGN.md are where a reader
looks for them. Cheap: reads files and builds the argparse parser (no server, no torch)."""
from __future__ import annotations

import argparse
import glob
import itertools
import re
import subprocess
from pathlib import Path

import pytest

from gateway.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

# ---- markdown parsing ------------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        if fence is None:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, every character that is not a letter,
    digit, `_`, `-` or space dropped, each space made a `-` (github-slugger)."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)             # inline code keeps its text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)           # links and images keep their text
    text = re.sub(r"<[^>]+>", "", text)                              # inline HTML
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")                  # duplicates: -1, -2, ...
    return found


def links(path: Path) -> list[str]:
    out = []
    for line in prose_lines(path.read_text()):
        out += LINK.findall(CODE_SPAN.sub("", line))
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of one markdown file that do not resolve (file or folder, then the anchor)."""
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):           # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no file {dest})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


def markdown_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.split()
        files = [REPO / n for n in names]
    except (OSError, subprocess.CalledProcessError):                  # not a git checkout
        files = []
    files += [REPO / "README.md", *DOCS.glob("*.md"), REPO / "benchmarks" / "README.md",
              REPO / "examples" / "README.md", *REPO.glob("deploy*/**/*.md")]
    return sorted({f for f in files if f.exists()})


# ---- links ------------------------------------------------------------------------------------------------------

def test_github_slug_rules():
    assert github_slug("### `loraplex serve` flags".lstrip("# ")) == "loraplex-serve-flags"
    assert github_slug("Thousands of adapters: `--lora-dir` (loaded on first request)") == \
        "thousands-of-adapters---lora-dir-loaded-on-first-request"
    assert github_slug("The GPU run: `benchmarks/gpu_run.sh`") == "the-gpu-run-benchmarksgpu_runsh"
    assert github_slug("What one constraint may cost, and where") == "what-one-constraint-may-cost-and-where"
    assert github_slug("Set-up: the two commands") == "set-up-the-two-commands"


def test_link_checker_finds_what_is_broken(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section, with `code`\n\n## A section, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](other.md) [ok](other.md#a-section-with-code) [ok](other.md#a-section-with-code-1)\n"
        "[ok](#title) [ok](https://example.com/x.md#nothing) `[not a link](missing.md)`\n"
        "```\n[in a code block](missing.md)\n```\n"
        "[bad](missing.md) [bad](other.md#no-such-section) [bad](#nothing-here)\n"
        "[bad](other.md#a-section-with-code-2)\n")
    bad = broken_links(page)
    assert len(bad) == 4, bad
    assert all(any(t in b for b in bad) for t in ("missing.md", "#no-such-section", "#nothing-here", "code-2"))


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path):
    assert broken_links(path) == [], f"{path.relative_to(REPO)} has broken links"


def test_the_docs_pages_exist_and_the_readme_links_them():
    readme = links(REPO / "README.md")
    for page in ("architecture", "http-api", "cli", "adapters-and-tenants", "structured-output",
                 "models-and-quantization", "tensor-parallelism", "speculative-decoding", "deployment",
                 "environment", "testing"):
        assert (DOCS / f"{page}.md").exists(), page
        assert f"docs/{page}.md" in readme, f"README.md does not link docs/{page}.md"
    assert "benchmarks/README.md" in readme


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) < 250


# ---- repository paths cited in backticks ------------------------------------------------------------------------

TOP = ("core", "adapters", "grammar", "gateway", "tests", "benchmarks", "examples", "deploy", "deploy-tp", "docs",
       "scripts")
GENERATED = ("benchmarks/.cache/", "benchmarks/results/tmp/")     # git-ignored, made by runs


def expand_braces(text: str) -> list[str]:
    m = re.search(r"\{([^{}]*,[^{}]*)\}", text)
    if not m:
        return [text]
    return list(itertools.chain.from_iterable(
        expand_braces(text[:m.start()] + alt + text[m.end():]) for alt in m.group(1).split(",")))


def cited_paths(path: Path) -> set[str]:
    cited = set()
    for line in prose_lines(path.read_text()):
        for span in (m.group(2) for m in CODE_SPAN.finditer(line)):
            span = span.strip()
            if re.fullmatch(rf"(?:{'|'.join(map(re.escape, TOP))})/[\w./*{{}},+-]*", span) and "..." not in span:
                cited.add(span)
    return cited


@pytest.mark.parametrize("path", [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "benchmarks" / "README.md",
                                  REPO / "examples" / "README.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_cited_paths_exist(path: Path):
    missing = []
    for cited in sorted(cited_paths(path)):
        if cited.startswith(GENERATED):
            continue
        for each in expand_braces(cited):   # from the repository root, or from the page's folder
            if not glob.glob(str(REPO / each)) and not glob.glob(str(path.parent / each)):
                missing.append(each)
    assert missing == [], f"{path.relative_to(REPO)} cites paths that do not exist"


# ---- the CLI, the metrics and DESIGN.md's contract names -------------------------------------------------------

def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def serve_flags() -> set[str]:
    return {opt for action in serve_parser()._actions for opt in action.option_strings if opt not in ("-h", "--help")}


def mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_serve_flag_is_on_the_cli_page():
    flags = serve_flags()
    assert {"--model", "--lora-dir", "-tp", "--tensor-parallel-size", "--no-enable-prefix-caching"} <= flags
    doc = (DOCS / "cli.md").read_text()
    assert sorted(f for f in flags if not mentions(doc, f)) == []


def exported_metrics() -> set[str]:
    source = (REPO / "gateway" / "observability" / "metrics.py").read_text()
    return set(re.findall(r"\"(loraplex:[a-z0-9_]+)\"", source))


def test_every_exported_metric_is_on_the_deployment_page():
    names = exported_metrics()
    assert {"loraplex:num_requests_waiting", "loraplex:request_aborted",
            "loraplex:e2e_request_latency_seconds"} <= names
    doc = (DOCS / "deployment.md").read_text()
    assert sorted(n for n in names if n not in doc) == []


# The contract names of DESIGN.md (the CLI, the metrics, the routes, the tenant file), and the page a reader
# opens for each. Checked against DESIGN.md itself where the checkout has it beside the repository.
DESIGN_FLAGS = (
    "--model", "--served-model-name", "--host", "--port", "--device", "--dtype", "--lora-modules", "--max-loras",
    "--max-cpu-loras", "--max-lora-rank", "--block-size", "--kv-cache-memory", "--gpu-memory-utilization",
    "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--no-prefix-caching", "--api-key",
    "--tenant-keys", "--admin-token", "--lora-dir", "--tensor-parallel-size", "--enable-lora", "--chat-template",
    "--generation-config", "--enable-auto-tool-choice", "--tool-call-parser", "--disable-log-requests",
    "--enable-log-requests", "--disable-uvicorn-access-log", "--disable-log-stats", "--uvicorn-log-level",
    "--trust-remote-code", "--enable-prefix-caching", "--enable-chunked-prefill", "-tp", "--max-logprobs",
    "--reasoning-parser", "--quantization", "--speculative-config", "--metrics-port", "--engine-process",
    "--max-step-ms",
)
DESIGN_METRICS = (
    "loraplex:num_requests_running", "loraplex:num_requests_waiting", "loraplex:kv_cache_usage_perc",
    "loraplex:cache_config_info", "loraplex:lora_requests_info", "loraplex:request_aborted_total",
    "loraplex:spec_decode_num_draft_tokens_total", "loraplex:spec_decode_num_accepted_tokens_total",
)
WHERE = {
    "http-api.md": ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/tokenize",
                    "/detokenize", "/v1/responses", "/health", "/metrics", "/ping", "/version", "model_not_found",
                    "context_length_exceeded", "response_format", "structured_outputs", "stream_options",
                    "max_completion_tokens", "stop_token_ids", "ignore_eos", "logit_bias", "prompt_logprobs",
                    "chat_template_kwargs", "include_stop_str_in_output"),
    "adapters-and-tenants.md": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "lora_name", "lora_path",
                                "api_keys", "requests_per_minute", "max_concurrent_requests",
                                "max_tokens_per_minute", "max_running_sequences", "--lora-dir", "--tenant-keys"),
    "structured-output.md": ("json_schema", "json_object", "unsupported_json_schema", "tool_choice",
                             "parallel_tool_calls", "reasoning_content", "guided_json", "guided_grammar"),
    "speculative-decoding.md": ("ngram", "draft_model", "num_speculative_tokens", "prompt_lookup_min",
                                "prompt_lookup_max", "disable_by_batch_size", "get_metrics"),
    "deployment.md": ("LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN", "--metrics-port", "/health/live"),
}


def design_md() -> str | None:
    for parent in REPO.parents:
        candidate = parent / "shared" / "DESIGN.md"
        if candidate.exists():
            return candidate.read_text()
    return None


def test_design_contract_names_are_where_a_reader_looks():
    cli, deployment = (DOCS / "cli.md").read_text(), (DOCS / "deployment.md").read_text()
    assert [f for f in DESIGN_FLAGS if not mentions(cli, f)] == []
    assert [m for m in DESIGN_METRICS if m not in deployment] == []
    for page, names in WHERE.items():
        doc = (DOCS / page).read_text()
        assert [n for n in names if n not in doc] == [], page
    readme = (REPO / "README.md").read_text()
    assert all(n in readme for n in ("from core import LLM, SamplingParams", "lora_modules", "response_format",
                                     "bash scripts/dev.sh serve", "bash scripts/dev.sh test"))


def test_design_md_names_are_documented():
    design = design_md()
    if design is None:
        pytest.skip("no shared/DESIGN.md beside this checkout (the constants above stand for it)")
    flags = serve_flags()
    named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", design)) & flags   # flags not built yet are skipped
    assert named >= {"--model", "--lora-dir", "--metrics-port"}
    assert sorted(named - set(DESIGN_FLAGS)) == [], "DESIGN.md names flags DESIGN_FLAGS lacks"
    metrics = set(re.findall(r"loraplex:[a-z0-9_]+", design))
    assert sorted(metrics - set(DESIGN_METRICS)) == [], "DESIGN.md names metrics DESIGN_METRICS lacks"
