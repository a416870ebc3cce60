"""Compare xgrammar and llguidance on CPU: grammar compile time and per-row mask time.

`python benchmarks/cfg_library_choice.py --tokenizer DIR [--tokenizer DIR2]` (local HF tokenizer dirs, e.g. the
stdlib-trained BPE tokenizers of tiny_models.build_tokenizer at 32k / 128k).  Prints a markdown table.
Each grammar is walked along a valid sentence: at every step the mask is filled (timed), then the sentence's
next token is consumed.  The numbers explain why grammar/cfg/cfg_grammar.py uses xgrammar (see benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

EXPR_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EXPR_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
SQL_LARK = r"""
start: "SELECT " cols " FROM " NAME where? ";"
cols: NAME (", " NAME)*
where: " WHERE " cond (" AND " cond)*
cond: NAME " " OP " " value
value: NUMBER | "'" /[a-z ]*/ "'"
OP: "=" | "<" | ">"
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /[0-9]+/
"""
SQL_GBNF = r"""
root ::= "SELECT " cols " FROM " name where? ";"
cols ::= name (", " name)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= name " " op " " value
value ::= number | "'" [a-z ]* "'"
op ::= "=" | "<" | ">"
name ::= [a-z_] [a-z0-9_]*
number ::= [0-9]+
"""
WORKLOADS = {
    "expr": (EXPR_LARK, EXPR_GBNF, "(12+3)*45-(6/(7+8))*9+100-(20*30)/4"),
    "sql": (SQL_LARK, SQL_GBNF, "SELECT name, age, city FROM users WHERE age > 30 AND city = 'new york';"),
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_llguidance(tok, text_ids: list[int], lark: str, vocab: int) -> tuple[float, list[float]]:  # noqa: ANN001
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)   # first mask: lazy lexer build
    compile_s = time.perf_counter() - t0
    times = []
    for t in text_ids:
        s = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - s)
        assert matcher.consume_token(t), matcher.get_error()
    return compile_s, times


def bench_xgrammar(tok, text_ids: list[int], gbnf: str, vocab: int) -> tuple[float, list[float]]:  # noqa: ANN001
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_grammar(gbnf)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in text_ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - s)
        assert matcher.accept_token(t)
    return compile_s, times


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", action="append", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| vocab | workload | library | compile p50 ms | mask p50 us | mask p99 us |")
    print("|---|---|---|---|---|---|")
    for path in args.tokenizer:
        tok = AutoTokenizer.from_pretrained(path)
        vocab = len(tok)
        for name, (lark, gbnf, text) in WORKLOADS.items():
            ids = tok.encode(text, add_special_tokens=False)
            for lib, fn, g in (("llguidance", bench_llguidance, lark), ("xgrammar", bench_xgrammar, gbnf)):
                compiles, masks = [], []
                for _ in range(args.repeats):
                    c, m = fn(tok, ids, g, vocab)
                    compiles.append(c)
                    masks.extend(m)
                print(f"| {vocab} | {name} | {lib} | {statistics.median(compiles) * 1e3:.2f} | "
                      f"{pct(masks, 0.5) * 1e6:.1f} | {pct(masks, 0.99) * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
