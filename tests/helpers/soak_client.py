"""A reusable soak workload for a running loraplex server (loopback only): many concurrent, random requests.

    stats = asyncio.run(run_soak(SoakConfig(base_url="http://127.0.0.1:8000", base_model="tiny",
                                            adapters=("a", "b"), num_requests=2000, concurrency=24, seed=1)))
    stats.summary()          # one printable block: requests/s, status histogram, disconnects, ...
    stats.violations         # every contract breach seen (5xx, malformed bodies, schema failures, hangs)

Each request picks at random: endpoint (completions / chat), model (base, an adapter, the hot-loaded adapter,
an unknown name -> 404), prompt (text, unicode, a shared prefix, token ids, a list of prompts; chat content
parts and multi-turn), streaming or not, n 1-3, temperature / top_p / top_k / seed, stop strings and stop
token ids, ignore_eos, response_format (text / json_object / small json_schemas), logprobs,
`stream_options.include_usage`; now and then a bad body (-> 4xx in the OpenAI error shape), a stream closed
after k chunks (client disconnect), a request cancelled after a random delay, a probe (/health, /metrics,
/v1/models), or a repeat of an earlier greedy / seeded request (its choices must be the same, whatever the
batch, preemptions, chunked prefill, prefix-cache hits or stream mode). An optional admin task hot-loads and
unloads an adapter (from alternating paths) while requests for it are in flight: they must finish or get
404, never 5xx.

Every answer is checked: no 5xx, errors in the `{"error": {message, type, param, code}}` shape, successful
bodies well-formed (usage present and consistent, `finish_reason` in stop/length, `n` choices, token counts
within `max_tokens`, stop strings cut, `json_schema` / `json_object` outputs that end in `stop` valid JSON
that satisfies the schema). Streams must end with `data: [DONE]`, carry one finish_reason per choice and no
in-band error. A request the server does not answer within `request_timeout_s` is a violation (a hang).
Deterministic-repeat mismatches are listed in `stats.mismatches`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

# ---------------------------------------------------------------------------------------------------------------
# workload data

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Cache:\n    def __init__(self, size):\n",
    "x",
    "for i in range(10):\n    print(i)\n",
    "# Copyright 2001 Python Software Foundation\n",
    "while True:\n    line = stream.readline()\n",
    "return {k: v for k, v in items}",
    "Hello",
    "The quick brown fox",
    "héllo wörld ✓ naïve café 日本語 ",
    "emoji 🙂🚀 and ümlauts: ",
]
# a shared, block-sized-and-longer prefix so the radix cache gets hits (and evictions under pressure)
SHARED_PREFIX = "# Licensed under the Apache License, Version 2.0 (the \"License\");\n# you may not use this file\n"
STOPS = ["\n", " ", "e", "):", "import", "\n\n", "the", "é", "ö ", "\ufffd"]

SCHEMAS: list[dict[str, Any]] = [
    {"enum": ["red", "green", "blue"]},
    {"type": "boolean"},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "string", "maxLength": 5},
    {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    {"type": "integer", "minimum": 3, "maximum": 40},
    {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
]
UNKNOWN_MODEL = "no-such-model"

# bad bodies: (name, endpoint, raw body or dict, allowed statuses). Sent as-is; the server must answer 4xx
# in the OpenAI error shape. `{base}` in a string value is replaced by the base model's name.
BAD_BODIES: list[tuple[str, str, Any, frozenset[int]]] = [
    ("malformed json", "completions", b'{"model": "{base}", "prompt": "x"', frozenset({400})),
    ("not an object", "completions", b"[1, 2, 3]", frozenset({400})),
    ("binary garbage", "chat", b"\xff\xfe\x00garbage", frozenset({400})),
    ("empty body", "completions", b"", frozenset({400})),
    ("unknown field", "completions", {"model": "{base}", "prompt": "x", "frobnicate": 1}, frozenset({400})),
    ("wrong type", "completions", {"model": "{base}", "prompt": "x", "max_tokens": "ten"}, frozenset({400})),
    ("missing prompt", "completions", {"model": "{base}", "max_tokens": 2}, frozenset({400})),
    ("empty messages", "chat", {"model": "{base}", "messages": []}, frozenset({400})),
    ("bad role", "chat", {"model": "{base}", "messages": [{"role": "wizard", "content": "x"}]}, frozenset({400})),
    ("n zero", "completions", {"model": "{base}", "prompt": "x", "n": 0}, frozenset({400})),
    ("max_tokens zero", "chat", {"model": "{base}", "messages": [{"role": "user", "content": "x"}],
                                 "max_tokens": 0}, frozenset({400})),
    ("negative temperature", "completions", {"model": "{base}", "prompt": "x", "temperature": -1.0},
     frozenset({400})),
    ("too long", "completions", {"model": "{base}", "prompt": "x", "max_tokens": 100000}, frozenset({400})),
    ("bad response_format", "completions", {"model": "{base}", "prompt": "x", "response_format": {"type": "xml"}},
     frozenset({400})),
    ("json_schema missing", "chat", {"model": "{base}", "messages": [{"role": "user", "content": "x"}],
                                     "response_format": {"type": "json_schema"}}, frozenset({400})),
    ("unsupported schema", "completions",
     {"model": "{base}", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"not": {}}}}}, frozenset({400})),
    ("unsatisfiable schema", "chat",
     {"model": "{base}", "messages": [{"role": "user", "content": "x"}], "response_format": {
         "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                         "maximum": 3}}}}, frozenset({400})),
    ("invalid schema", "completions",
     {"model": "{base}", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": 12}}}}, frozenset({400})),
    ("stream_options without stream", "completions",
     {"model": "{base}", "prompt": "x", "stream_options": {"include_usage": True}}, frozenset({400})),
    ("negative stop id", "completions", {"model": "{base}", "prompt": "x", "stop_token_ids": [-1]},
     frozenset({400})),
    ("token id out of range", "completions", {"model": "{base}", "prompt": [10**9]}, frozenset({400})),
    ("logprobs too many", "completions", {"model": "{base}", "prompt": "x", "logprobs": 99}, frozenset({400})),
    ("top_logprobs without logprobs", "chat", {"model": "{base}", "messages": [{"role": "user", "content": "x"}],
                                               "top_logprobs": 2}, frozenset({400})),
    ("logit_bias outside the vocabulary", "completions", {"model": "{base}", "prompt": "x",
                                                          "logit_bias": {"1000000": 1}}, frozenset({400})),
    ("tools", "chat", {"model": "{base}", "messages": [{"role": "user", "content": "x"}],
                       "tools": [{"type": "function"}]}, frozenset({400})),
    ("unknown model in bad body", "completions", {"model": UNKNOWN_MODEL, "prompt": "x", "max_tokens": 1},
     frozenset({404})),
]
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------------------------
# configuration and results

@dataclass
class SoakConfig:
    base_url: str                               # http://127.0.0.1:PORT (loopback only)
    base_model: str                             # the base model's served name
    adapters: tuple[str, ...] = ()              # adapters loaded for the whole run
    num_requests: int = 2000
    concurrency: int = 24
    seed: int = 0
    max_duration_s: float = 90.0                # stop issuing new requests after this (bounded in time)
    request_timeout_s: float = 60.0             # no answer within this -> a violation (a hang)
    max_tokens: tuple[int, int] = (1, 24)
    schema_max_tokens: tuple[int, int] = (4, 40)
    api_key: str | None = None
    # the hot adapter: loaded / unloaded by the admin task while requests for it are in flight
    admin_token: str | None = None
    hot_adapter: str | None = None              # served name of the hot adapter
    hot_paths: tuple[str, ...] = ()             # adapter dirs it is loaded from (cycled: reload = new weights)
    hot_cycles: int = 4                         # load/unload cycles during the run
    # probabilities
    p_chat: float = 0.5
    p_stream: float = 0.5
    p_unknown_model: float = 0.04
    p_hot: float = 0.12
    p_bad_body: float = 0.05
    p_disconnect: float = 0.10                  # of streams: close after k chunks
    p_cancel: float = 0.08                      # of non-streaming requests: cancel after a random delay
    p_schema: float = 0.15
    p_json_object: float = 0.05
    p_logprobs: float = 0.15
    p_stop: float = 0.25
    p_n2: float = 0.2
    p_probe: float = 0.02                       # GET /health, /metrics, /v1/models
    p_multi_prompt: float = 0.08                # completions: a list of 2 prompts
    p_token_prompt: float = 0.05                # completions: a prompt of token ids (from `token_prompts`)
    token_prompts: tuple[tuple[int, ...], ...] = ()   # encoded texts: they end on a whole character
    # completions: random token ids, which may end inside a UTF-8 character (once leaked prompt bytes into
    # the output: tests/test_core/engine/test_engine_regressions.py)
    p_raw_token_prompt: float = 0.05
    vocab_size: int = 256                       # random ids are drawn from [3, vocab_size)
    # `stop_token_ids` on json_schema / json_object requests too (a terminating stop token's text once stayed in
    # the output: tests/test_core/engine/test_engine_regressions.py)
    grammar_stop_token_ids: bool = True
    p_big: float = 0.0                          # max_tokens from big_max_tokens (KV pressure, long streams)
    big_max_tokens: tuple[int, int] = (100, 300)
    p_no_max_tokens: float = 0.0                # no max_tokens at all (the rest of the context)
    # statuses any request may get on top of its own (e.g. 408 with --request-timeout, 429 with tenant limits
    # or --max-queue-len), and in-band stream error codes that may end a stream (e.g. "request_timeout")
    extra_statuses: frozenset[int] = frozenset()
    inband_ok_codes: frozenset[str] = frozenset()
    p_repeat: float = 0.15                      # re-send an earlier greedy / seeded request (stream mode flipped
                                                # at random): its choices must be the same


@dataclass
class SoakStats:
    statuses: Counter = field(default_factory=Counter)          # HTTP status -> count (probes excluded)
    inband_ok_codes: frozenset[str] = frozenset()
    extra_statuses: frozenset[int] = frozenset()
    by_label: Counter = field(default_factory=Counter)          # "label status" -> count
    outcomes: Counter = field(default_factory=Counter)          # what happened, by label
    finish_reasons: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    admin: list[tuple[str, int]] = field(default_factory=list)  # (action, status)
    hot_in_flight_at_unload: list[int] = field(default_factory=list)   # client-side count at each unload
    hot_in_flight: int = 0
    # hot adapter epochs: +1 before and after each admin call; hot_paths[epoch] = the path surely loaded then
    hot_epoch: int = 0
    hot_paths: dict[int, str] = field(default_factory=dict)
    # determinism: greedy / seeded requests with the same inputs must give the same choices
    outputs: dict[str, tuple[Any, str]] = field(default_factory=dict)
    num_repeats: Counter = field(default_factory=Counter)        # greedy / seeded -> repeats compared
    mismatches: list[str] = field(default_factory=list)
    num_sent: int = 0
    num_disconnects: int = 0
    num_cancels: int = 0
    num_schema_validated: int = 0
    num_completion_tokens: int = 0
    elapsed_s: float = 0.0

    def violation(self, what: str) -> None:
        if len(self.violations) < 500:
            self.violations.append(what)

    @property
    def num_5xx(self) -> int:
        return sum(c for s, c in self.statuses.items() if isinstance(s, int) and s >= 500)

    def summary(self) -> str:
        rate = self.num_sent / self.elapsed_s if self.elapsed_s else 0.0
        lines = [
            f"soak: {self.num_sent} requests in {self.elapsed_s:.1f}s ({rate:.1f} req/s), "
            f"{self.num_completion_tokens} completion tokens",
            "  statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items(), key=lambda i: str(i[0]))),
            "  outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items())),
            "  finish reasons: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.finish_reasons.items())),
            f"  disconnects (streams closed early): {self.num_disconnects}, cancellations: {self.num_cancels}, "
            f"schema outputs validated: {self.num_schema_validated}",
            f"  admin: {dict(Counter(f'{a}={s}' for a, s in self.admin))}, hot-adapter requests in flight at "
            f"each unload: {self.hot_in_flight_at_unload}",
            "  by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.by_label.items())),
            f"  determinism: {dict(self.num_repeats)} repeated requests compared, {len(self.mismatches)} mismatches",
            f"  violations: {len(self.violations)}",
        ]
        lines += [f"    - {v}" for v in self.violations[:25]]
        lines += [f"    ~ {m}" for m in self.mismatches[:10]]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# one request

@dataclass
class Plan:
    kind: str                                   # completions | chat
    body: Any                                   # dict (sent as JSON) or bytes (sent raw)
    stream: bool = False
    expect: frozenset[int] = frozenset({200})
    label: str = "ok"
    schema: dict[str, Any] | None = None        # validate `stop` outputs against it
    json_object: bool = False
    stops: tuple[str, ...] = ()
    n: int = 1
    num_prompts: int = 1                        # completions with a list of prompts: num_prompts * n choices
    max_tokens: int | None = None
    logprobs: bool = False
    include_usage: bool = False
    disconnect_after: int | None = None         # streams: close after this many chunks
    cancel_after_s: float | None = None         # cancel the request (streamed or not) after this delay
    epoch: int = -1                             # the hot adapter epoch when sent


def _fill(value: Any, base: str) -> Any:
    if isinstance(value, dict):
        return {k: _fill(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, base) for v in value]
    if isinstance(value, str):
        return value.replace("{base}", base)
    if isinstance(value, bytes):
        return value.replace(b"{base}", base.encode())
    return value


def make_plan(rng: random.Random, cfg: SoakConfig, hot_enabled: bool) -> Plan:
    if rng.random() < cfg.p_bad_body:
        label, kind, body, expect = rng.choice(BAD_BODIES)
        return Plan(kind=kind, body=_fill(body, cfg.base_model), expect=expect, label=f"bad body: {label}")
    kind = "chat" if rng.random() < cfg.p_chat else "completions"
    stream = rng.random() < cfg.p_stream
    expect, label = frozenset({200}), "ok"
    r = rng.random()
    if r < cfg.p_unknown_model:
        model, expect, label = UNKNOWN_MODEL, frozenset({404}), "unknown model"
    elif hot_enabled and r < cfg.p_unknown_model + cfg.p_hot:
        model, expect, label = cfg.hot_adapter, frozenset({200, 404}), "hot adapter"
    else:
        model = rng.choice((cfg.base_model, cfg.base_model) + tuple(cfg.adapters))
    prompt = rng.choice(PROMPTS) * rng.randint(1, 3)
    if rng.random() < 0.3:
        prompt = SHARED_PREFIX + prompt
    body: dict[str, Any] = {"model": model}
    if kind == "chat":
        content: Any = prompt
        if rng.random() < 0.15:   # content parts
            cut = rng.randint(0, len(prompt))
            content = [{"type": "text", "text": prompt[:cut]}, {"type": "text", "text": prompt[cut:]}]
        messages = [{"role": "user", "content": content}]
        if rng.random() < 0.15:   # a multi-turn conversation
            messages = [{"role": "user", "content": rng.choice(PROMPTS)},
                        {"role": "assistant", "content": rng.choice(PROMPTS)}] + messages
        if rng.random() < 0.2:
            messages.insert(0, {"role": "system", "content": "You are terse."})
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    plan = Plan(kind=kind, body=body, stream=stream, expect=expect, label=label)
    if kind == "completions":
        p = rng.random()
        if p < cfg.p_multi_prompt:
            plan.num_prompts = 2
            body["prompt"] = [prompt, rng.choice(PROMPTS)]
        elif p < cfg.p_multi_prompt + cfg.p_token_prompt:
            if cfg.token_prompts:
                body["prompt"] = list(rng.choice(cfg.token_prompts))
        elif p < cfg.p_multi_prompt + cfg.p_token_prompt + cfg.p_raw_token_prompt:
            body["prompt"] = [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(1, 40))]
    rf = rng.random()
    if rf < cfg.p_schema:
        plan.schema = rng.choice(SCHEMAS)
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "soak", "schema": plan.schema}}
        plan.max_tokens = rng.randint(*cfg.schema_max_tokens)
    elif rf < cfg.p_schema + cfg.p_json_object:
        plan.json_object = True
        body["response_format"] = {"type": "json_object"}
        plan.max_tokens = rng.randint(*cfg.schema_max_tokens)
    else:
        if rng.random() < 0.1:
            body["response_format"] = {"type": "text"}
        plan.max_tokens = rng.randint(*cfg.max_tokens)
        if rng.random() < cfg.p_big:
            plan.max_tokens = rng.randint(*cfg.big_max_tokens)
            plan.label += " big"
            plan.expect |= {400}      # a small KV pool may not hold it: 400 context_length_exceeded
    if rng.random() < cfg.p_no_max_tokens:
        plan.max_tokens = None
        plan.label += " unbounded"
        plan.expect |= {400}
    else:
        body["max_completion_tokens" if kind == "chat" and rng.random() < 0.3 else "max_tokens"] = plan.max_tokens
    if rng.random() < cfg.p_n2:
        plan.n = body["n"] = rng.choice((2, 2, 3))
    t = rng.random()
    if t < 0.3:
        body["temperature"] = 0.0
    elif t < 0.8:
        body["temperature"] = round(rng.uniform(0.2, 1.5), 2)
        if rng.random() < 0.3:
            body["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if rng.random() < 0.2:
            body["top_k"] = rng.randint(1, 50)
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31)
    if plan.schema is None and not plan.json_object and rng.random() < cfg.p_stop:
        plan.stops = tuple(rng.sample(STOPS, rng.randint(1, 2)))
        body["stop"] = plan.stops[0] if len(plan.stops) == 1 and rng.random() < 0.5 else list(plan.stops)
    if rng.random() < 0.05:
        body["ignore_eos"] = True
    constrained = plan.schema is not None or plan.json_object
    if rng.random() < 0.05 and (cfg.grammar_stop_token_ids or not constrained):
        body["stop_token_ids"] = [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.15:   # penalty rows: their device slots are taken and freed under preemption and aborts
        body["frequency_penalty"] = round(rng.uniform(-1, 1), 2)
        body["repetition_penalty"] = round(rng.uniform(0.8, 1.3), 2)
        body["logit_bias"] = {str(rng.randrange(3, cfg.vocab_size)): rng.choice((-100, -2, 3)) for _ in range(3)}
    if rng.random() < cfg.p_logprobs:
        plan.logprobs = True
        if kind == "chat":
            body["logprobs"] = True
            if rng.random() < 0.5:
                body["top_logprobs"] = rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            plan.include_usage = True
            body["stream_options"] = {"include_usage": True}
        if rng.random() < cfg.p_disconnect:
            plan.disconnect_after = rng.randint(0, 4)
        elif rng.random() < cfg.p_cancel / 2:   # gone at a random time: before the headers, or mid-stream
            plan.cancel_after_s = rng.uniform(0.0, 0.4)
    elif rng.random() < cfg.p_cancel:
        plan.cancel_after_s = rng.uniform(0.0, 0.4)
    return plan


def repeat_plan(rng: random.Random, plan: Plan) -> Plan:
    """The same request again (a copy), streamed or not, never disconnected or cancelled."""
    body = json.loads(json.dumps(plan.body))
    stream = rng.random() < 0.5
    body.pop("stream", None)
    body.pop("stream_options", None)
    include_usage = False
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            include_usage = True
            body["stream_options"] = {"include_usage": True}
    return dataclasses.replace(plan, body=body, stream=stream, include_usage=include_usage, disconnect_after=None,
                               cancel_after_s=None, label=plan.label + " repeat")


def _deterministic(plan: Plan) -> bool:
    body = plan.body
    return (isinstance(body, dict) and plan.label in ("ok", "hot adapter")
            and (body.get("temperature") == 0.0 or body.get("seed") is not None))


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _desc(plan: Plan) -> str:
    body = plan.body if isinstance(plan.body, dict) else repr(plan.body[:80])
    return f"{plan.label} {plan.kind} body={json.dumps(body, default=repr)[:400]}"


def check_error_shape(status: int, data: Any, plan: Plan, stats: SoakStats) -> None:
    if not (isinstance(data, dict) and isinstance(data.get("error"), dict) and set(data["error"]) == ERROR_KEYS):
        stats.violation(f"{status} without the OpenAI error shape: {str(data)[:300]} for {_desc(plan)}")
        return
    err = data["error"]
    if not isinstance(err["message"], str) or not err["message"]:
        stats.violation(f"{status} with an empty error message: {err} for {_desc(plan)}")
    if status == 404 and plan.label in ("unknown model", "hot adapter") and err["code"] != "model_not_found":
        stats.violation(f"404 with code {err['code']!r} (want model_not_found) for {_desc(plan)}")
    if status == 400 and not plan.label.startswith("bad body") and err["code"] != "context_length_exceeded":
        stats.violation(f"400 {err} for {_desc(plan)}")


def _validate_json_text(text: str, plan: Plan, stats: SoakStats) -> None:
    try:
        value = json.loads(text)
    except ValueError:
        stats.violation(f"finish_reason stop but the output is not JSON: {text!r} for {_desc(plan)}")
        return
    if plan.json_object and not isinstance(value, dict):
        stats.violation(f"json_object output is not an object: {text!r} for {_desc(plan)}")
        return
    if plan.schema is not None:
        import jsonschema
        from format_checks import strict_validate

        try:
            strict_validate(value, plan.schema)
        except jsonschema.ValidationError as exc:
            stats.violation(f"output {text!r} fails its schema ({exc.message}) for {_desc(plan)}")
            return
    stats.num_schema_validated += 1


def check_choice_text(text: str, finish: Any, ntokens: int | None, plan: Plan, stats: SoakStats) -> None:
    """One choice of a successful response (streamed or not), its text assembled."""
    stats.finish_reasons[str(finish)] += 1
    if finish not in ("stop", "length"):
        stats.violation(f"finish_reason {finish!r} for {_desc(plan)}")
        return
    if ntokens is not None and plan.max_tokens is not None:
        if ntokens > plan.max_tokens:
            stats.violation(f"{ntokens} tokens > max_tokens {plan.max_tokens} for {_desc(plan)}")
        if finish == "length" and ntokens != plan.max_tokens:
            stats.violation(f"finish_reason length after {ntokens} tokens, max_tokens {plan.max_tokens} "
                            f"for {_desc(plan)}")
    if (plan.schema is not None or plan.json_object) and finish == "stop":
        _validate_json_text(text, plan, stats)
    for stop in plan.stops:
        if stop in text:
            stats.violation(f"the output {text!r} contains its stop string {stop!r} for {_desc(plan)}")


def check_usage(usage: Any, plan: Plan, stats: SoakStats, where: str) -> int:
    if not isinstance(usage, dict) or not {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(usage):
        stats.violation(f"{where}: usage missing or incomplete: {usage!r} for {_desc(plan)}")
        return 0
    p, c, t = usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]
    if not (isinstance(p, int) and p > 0 and isinstance(c, int) and c >= 0 and t == p + c):
        stats.violation(f"{where}: inconsistent usage {usage} for {_desc(plan)}")
    if plan.max_tokens is not None and isinstance(c, int) and c > plan.n * plan.num_prompts * plan.max_tokens:
        stats.violation(f"{where}: {c} completion tokens > n * max_tokens for {_desc(plan)}")
    return c if isinstance(c, int) else 0


def _logprob_count(choice: dict[str, Any], kind: str) -> int | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    items = lp.get("content") if kind == "chat" else lp.get("tokens")
    return len(items) if isinstance(items, list) else None


def check_response(data: Any, plan: Plan, stats: SoakStats) -> None:
    """A non-streamed 200."""
    obj = "chat.completion" if plan.kind == "chat" else "text_completion"
    if not isinstance(data, dict) or data.get("object") != obj or not isinstance(data.get("choices"), list):
        stats.violation(f"malformed 200 body {str(data)[:300]} for {_desc(plan)}")
        return
    choices = data["choices"]
    if sorted(c.get("index") for c in choices) != list(range(plan.n * plan.num_prompts)):
        stats.violation(f"choice indexes {[c.get('index') for c in choices]} for n={plan.n}: {_desc(plan)}")
    completion = check_usage(data.get("usage"), plan, stats, "response")
    stats.num_completion_tokens += completion
    counted = 0
    for c in choices:
        if plan.kind == "chat":
            msg = c.get("message") or {}
            text = msg.get("content")
            if msg.get("role") != "assistant":
                stats.violation(f"chat message without role assistant: {c} for {_desc(plan)}")
        else:
            text = c.get("text")
        if not isinstance(text, str):
            stats.violation(f"choice without text: {c} for {_desc(plan)}")
            continue
        ntokens = _logprob_count(c, plan.kind) if plan.logprobs else None
        if plan.logprobs and ntokens is None:
            stats.violation(f"logprobs requested but missing: {str(c)[:200]} for {_desc(plan)}")
        counted += ntokens or 0
        check_choice_text(text, c.get("finish_reason"), ntokens, plan, stats)
    if plan.logprobs and counted != completion:
        stats.violation(f"{counted} logprob entries != {completion} completion tokens for {_desc(plan)}")
    texts = {c.get("index"): ((c.get("message") or {}).get("content") if plan.kind == "chat" else c.get("text"),
                              c.get("finish_reason")) for c in choices}
    record_output(plan, texts, stats)


def record_output(plan: Plan, choices: dict[Any, tuple[Any, Any]], stats: SoakStats) -> None:
    """Greedy (temperature 0) and seeded requests are deterministic: the same inputs, the same choices, whatever
    the batch, preemptions, chunking, prefix-cache hits or stream mode. The hot adapter counts only when the
    request ran entirely within one epoch in which a known path was loaded."""
    body = plan.body
    if not isinstance(body, dict):
        return
    greedy = body.get("temperature") == 0.0
    if not greedy and body.get("seed") is None:
        return
    model: Any = body.get("model")
    if plan.label.startswith("hot adapter"):
        path = stats.hot_paths.get(plan.epoch)
        if path is None or stats.hot_epoch != plan.epoch:
            return
        model = ["hot", path]
    ignored = {"model", "stream", "stream_options", "logprobs", "top_logprobs"}
    if greedy:
        ignored |= {"seed", "top_p", "top_k", "n"}   # n greedy samples are all the same
    inputs = {k: v for k, v in body.items() if k not in ignored}
    key = json.dumps([plan.kind, model, inputs], sort_keys=True)
    value = sorted(choices.items()) if not greedy else sorted({v for v in choices.values()})
    kind = "greedy" if greedy else "seeded"
    seen = stats.outputs.get(key)
    if seen is None:
        stats.outputs[key] = (value, "stream" if plan.stream else "plain")
        return
    stats.num_repeats[kind] += 1
    if seen[0] != value and len(stats.mismatches) < 200:
        stats.mismatches.append(f"{kind}: {seen[0]!r} ({seen[1]}) then {value!r} "
                                f"({'stream' if plan.stream else 'plain'}) for {_desc(plan)}")


async def _stream(client: httpx.AsyncClient, plan: Plan, stats: SoakStats) -> int:
    async with client.stream("POST", _path(plan.kind), json=plan.body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            _check_non_200(resp, plan, stats)
            return resp.status_code
        texts: dict[int, str] = {}
        finishes: dict[int, Any] = {}
        ntokens: dict[int, int] = {}
        usage: Any = None
        chunks = 0
        done = False
        inband: str | None = None
        async for line in resp.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                stats.violation(f"stream line without `data: `: {line[:200]!r} for {_desc(plan)}")
                continue
            payload = line[len("data: "):]
            if done:
                stats.violation(f"data after [DONE]: {payload[:200]!r} for {_desc(plan)}")
            if payload == "[DONE]":
                done = True
                continue
            chunks += 1
            if plan.disconnect_after is not None and chunks > plan.disconnect_after:
                stats.num_disconnects += 1
                stats.outcomes["stream disconnected"] += 1
                return 200   # leaving the context closes the connection mid-stream
            try:
                chunk = json.loads(payload)
            except ValueError:
                stats.violation(f"unparsable stream chunk {payload[:200]!r} for {_desc(plan)}")
                continue
            if "error" in chunk:
                code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
                if code not in stats.inband_ok_codes:
                    stats.violation(f"in-band stream error {payload[:300]} for {_desc(plan)}")
                elif inband is not None:
                    stats.violation(f"two in-band errors in one stream for {_desc(plan)}")
                inband = str(code)
                stats.outcomes[f"stream error {code}"] += 1
                continue
            if inband is not None:
                stats.violation(f"stream data after an in-band error: {payload[:200]} for {_desc(plan)}")
            if chunk.get("usage") is not None:
                usage = chunk["usage"]
                if chunk.get("choices"):
                    stats.violation(f"usage chunk with choices: {payload[:200]} for {_desc(plan)}")
                continue
            for c in chunk.get("choices", []):
                i = c.get("index")
                if i in finishes:
                    stats.violation(f"chunk for choice {i} after its finish_reason for {_desc(plan)}")
                if plan.kind == "chat":
                    piece = (c.get("delta") or {}).get("content") or ""
                else:
                    piece = c.get("text") or ""
                texts[i] = texts.get(i, "") + piece
                if plan.logprobs and c.get("logprobs") is not None:
                    ntokens[i] = ntokens.get(i, 0) + (_logprob_count(c, plan.kind) or 0)
                if c.get("finish_reason") is not None:
                    finishes[i] = c["finish_reason"]
        if not done:
            stats.violation(f"stream ended without [DONE] for {_desc(plan)}")
        if inband is not None:
            return 200
        if sorted(finishes) != list(range(plan.n * plan.num_prompts)):
            stats.violation(f"stream finish_reasons for choices {sorted(finishes)} (n={plan.n}) for {_desc(plan)}")
        for i, finish in finishes.items():
            check_choice_text(texts.get(i, ""), finish, ntokens.get(i) if plan.logprobs else None, plan, stats)
        if plan.include_usage:
            c = check_usage(usage, plan, stats, "stream")
            stats.num_completion_tokens += c
            if plan.logprobs and sum(ntokens.values()) != c:
                stats.violation(f"{sum(ntokens.values())} streamed logprob entries != {c} completion tokens "
                                f"for {_desc(plan)}")
        elif usage is not None:
            stats.violation(f"usage chunk without include_usage for {_desc(plan)}")
        record_output(plan, {i: (texts.get(i, ""), f) for i, f in finishes.items()}, stats)
        stats.outcomes["stream complete"] += 1
        return 200


def _check_non_200(resp: httpx.Response, plan: Plan, stats: SoakStats) -> None:
    try:
        data = resp.json()
    except ValueError:
        data = resp.text[:300]
    check_error_shape(resp.status_code, data, plan, stats)


async def _plain(client: httpx.AsyncClient, plan: Plan, stats: SoakStats) -> int:
    if isinstance(plan.body, bytes):
        resp = await client.post(_path(plan.kind), content=plan.body, headers={"content-type": "application/json"})
    else:
        resp = await client.post(_path(plan.kind), json=plan.body)
    if resp.status_code == 200:
        try:
            data = resp.json()
        except ValueError:
            stats.violation(f"200 with a non-JSON body {resp.text[:200]!r} for {_desc(plan)}")
            return 200
        check_response(data, plan, stats)
        stats.outcomes["complete"] += 1
    else:
        _check_non_200(resp, plan, stats)
    return resp.status_code


async def run_one(client: httpx.AsyncClient, plan: Plan, stats: SoakStats, timeout_s: float) -> None:
    stats.num_sent += 1
    plan.epoch = stats.hot_epoch
    hot = plan.label.startswith("hot adapter")
    stats.hot_in_flight += hot
    try:
        await _run_one(client, plan, stats, timeout_s)
    finally:
        stats.hot_in_flight -= hot


async def _run_one(client: httpx.AsyncClient, plan: Plan, stats: SoakStats, timeout_s: float) -> None:
    work = _stream(client, plan, stats) if plan.stream else _plain(client, plan, stats)
    task = asyncio.ensure_future(work)
    try:
        if plan.cancel_after_s is not None:
            done, _ = await asyncio.wait({task}, timeout=plan.cancel_after_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                stats.num_cancels += 1
                stats.outcomes["cancelled"] += 1
                return
        status = await asyncio.wait_for(task, timeout_s)
    except asyncio.TimeoutError:
        stats.violation(f"no answer within {timeout_s}s (hang) for {_desc(plan)}")
        stats.statuses["timeout"] += 1
        stats.by_label[f"{plan.label.split(':')[0]} timeout"] += 1
        return
    except httpx.HTTPError as exc:
        stats.violation(f"transport error {type(exc).__name__}: {exc} for {_desc(plan)}")
        stats.statuses["transport error"] += 1
        stats.by_label[f"{plan.label.split(':')[0]} transport error"] += 1
        return
    stats.statuses[status] += 1
    stats.by_label[f"{plan.label.split(':')[0]} {status}"] += 1
    if status >= 500:
        stats.violation(f"HTTP {status} for {_desc(plan)}")
    elif status not in plan.expect and status not in stats.extra_statuses:
        stats.violation(f"HTTP {status}, expected {sorted(plan.expect)} for {_desc(plan)}")


async def _probe(client: httpx.AsyncClient, rng: random.Random, stats: SoakStats) -> None:
    path = rng.choice(["/health", "/metrics", "/v1/models"])
    try:
        resp = await client.get(path)
    except httpx.HTTPError as exc:
        stats.violation(f"GET {path}: transport error {exc!r}")
        return
    stats.outcomes[f"probe {path} {resp.status_code}"] += 1
    if resp.status_code != 200:
        stats.violation(f"GET {path} -> {resp.status_code}: {resp.text[:200]}")
    elif path == "/metrics":
        values = {}
        for line in resp.text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("loraplex:kv_cache_usage_perc", "loraplex:num_requests_running",
                        "loraplex:num_requests_waiting"):
                values[name] = float(value)
        usage = values.get("loraplex:kv_cache_usage_perc", -1.0)
        if len(values) != 3 or not 0.0 <= usage <= 1.0 or min(values.values()) < 0:
            stats.violation(f"/metrics gauges out of range during the soak: {values}")


# ---------------------------------------------------------------------------------------------------------------
# the admin task: hot load / unload while requests for the adapter are in flight

async def admin_call(client: httpx.AsyncClient, token: str, route: str, body: dict[str, str]) -> httpx.Response:
    return await client.post(f"/v1/{route}", json=body, headers={"Authorization": f"Bearer {token}"})


async def _hot_task(client: httpx.AsyncClient, cfg: SoakConfig, stats: SoakStats, progress: Callable[[], float],
                    stop: asyncio.Event) -> None:
    assert cfg.admin_token and cfg.hot_adapter and cfg.hot_paths
    for cycle in range(cfg.hot_cycles):
        # spread the cycles over the run: load at (2c+0.5)/(2k), unload at (2c+1.5)/(2k) of its progress
        for action, at in (("load", (2 * cycle + 0.5) / (2 * cfg.hot_cycles)),
                           ("unload", (2 * cycle + 1.5) / (2 * cfg.hot_cycles))):
            while progress() < at and not stop.is_set():
                await asyncio.sleep(0.05)
            if stop.is_set() and action == "load":
                return
            stats.hot_epoch += 1
            path = cfg.hot_paths[cycle % len(cfg.hot_paths)]
            if action == "load":
                resp = await admin_call(client, cfg.admin_token, "load_lora_adapter",
                                        {"lora_name": cfg.hot_adapter, "lora_path": path})
            else:
                stats.hot_in_flight_at_unload.append(stats.hot_in_flight)
                resp = await admin_call(client, cfg.admin_token, "unload_lora_adapter",
                                        {"lora_name": cfg.hot_adapter})
            stats.hot_epoch += 1
            if action == "load" and resp.status_code == 200:
                stats.hot_paths[stats.hot_epoch] = path
            stats.admin.append((action, resp.status_code))
            if resp.status_code != 200:
                stats.violation(f"admin {action} of {cfg.hot_adapter} -> {resp.status_code}: {resp.text[:300]}")


# ---------------------------------------------------------------------------------------------------------------
# the run

async def run_soak(cfg: SoakConfig) -> SoakStats:
    stats = SoakStats(inband_ok_codes=cfg.inband_ok_codes, extra_statuses=cfg.extra_statuses)
    hot_enabled = bool(cfg.admin_token and cfg.hot_adapter and cfg.hot_paths)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    start = time.monotonic()
    deadline = start + cfg.max_duration_s
    issued = 0
    stop = asyncio.Event()
    repeatable: list[Plan] = []

    def progress() -> float:
        by_count = issued / max(1, cfg.num_requests)
        by_time = (time.monotonic() - start) / cfg.max_duration_s
        return max(by_count, by_time)

    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        async def worker(wid: int) -> None:
            nonlocal issued
            wrng = random.Random(f"{cfg.seed}-{wid}")
            while issued < cfg.num_requests and time.monotonic() < deadline:
                issued += 1
                if wrng.random() < cfg.p_probe:
                    await _probe(client, wrng, stats)
                if repeatable and wrng.random() < cfg.p_repeat:
                    plan = repeat_plan(wrng, wrng.choice(repeatable))
                else:
                    plan = make_plan(wrng, cfg, hot_enabled)
                    if _deterministic(plan) and len(repeatable) < 300:
                        repeatable.append(plan)
                await run_one(client, plan, stats, cfg.request_timeout_s)

        admin = asyncio.ensure_future(_hot_task(client, cfg, stats, progress, stop)) if hot_enabled else None
        await asyncio.gather(*(worker(i) for i in range(cfg.concurrency)))
        stop.set()
        if admin is not None:
            await admin
            # the run may end before the last unload: leave the hot adapter unloaded
            loaded = sum(1 if a == "load" and s == 200 else -1 if a == "unload" and s == 200 else 0
                         for a, s in stats.admin)
            if loaded > 0:
                resp = await admin_call(client, cfg.admin_token or "", "unload_lora_adapter",
                                        {"lora_name": cfg.hot_adapter or ""})
                stats.admin.append(("unload", resp.status_code))
    stats.elapsed_s = time.monotonic() - start
    return stats
