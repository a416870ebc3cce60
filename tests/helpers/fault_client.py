"""HTTP side of the fault-injection tests (tests/test_gateway/robustness/test_server_faults.py, test_soak_faults.py).

`Template`s are deterministic completions requests (greedy or seeded; base model, adapters, a JSON schema,
penalties + logit bias + min_tokens, log-probs); `send` posts one, streamed or not, and returns its `Outcome`:
the text, or the OpenAI error it got (a status, or an in-band SSE error event, which must be followed by
`[DONE]`). Faults are armed in the server's process with a predicate on the engine request
(`fault_injector.inject`), matched by the marker each prompt starts with.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@dataclass(frozen=True)
class Template:
    name: str
    prompt: str
    model: str | None = None          # None: the base model
    extra: tuple[tuple[str, Any], ...] = ()

    def body(self, base_model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model or base_model, "prompt": self.prompt, "max_tokens": 8,
                                "temperature": 0.0, "stream": stream}
        body.update(dict(self.extra))
        return body


def templates(adapters: tuple[str, ...]) -> list[Template]:
    """One template per kind of row (greedy rows of the base and of each adapter, then the rows with features);
    the prompt of each starts with its own marker."""
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return [
        Template("base", "alpha def fibonacci(n):\n    "),
        Template("adapter0", "bravo import os\nimport sys\n", adapters[0]),
        Template("adapter1", "charlie class Cache:\n", adapters[1]),
        Template("json", "delta A person as JSON: ", extra=(("response_format", schema), ("max_tokens", 30))),
        Template("penalty", "echo for i in range(10):\n", extra=(
            ("repetition_penalty", 1.3), ("frequency_penalty", 0.5), ("logit_bias", {"5": 2.0}), ("min_tokens", 4))),
        Template("logprobs", "foxtrot while True:\n", extra=(("logprobs", 2),)),
        Template("seeded", "golf x = [", adapters[0], extra=(("temperature", 0.8), ("top_p", 0.9), ("seed", 7))),
    ] + [Template(f"adapter{i}", f"{marker} while True:\n", name)   # more adapters: more device slots in use
         for i, (marker, name) in enumerate(zip(("hotel", "india", "juliett"), adapters[2:]), start=2)]


@dataclass
class Outcome:
    status: int
    text: str = ""
    error: dict[str, Any] | None = None     # the OpenAI error object (status >= 400, or in-band in a stream)
    done: bool = False                      # a stream ended with `data: [DONE]`
    request_id: str = ""                    # X-Request-Id: the engine request of choice 0 is f"{id}-0"
    finish_reason: str | None = None
    problems: list[str] = field(default_factory=list)


async def send(client: httpx.AsyncClient, base_model: str, tpl: Template, stream: bool,
               timeout_s: float = 60.0) -> Outcome:
    body = tpl.body(base_model, stream)
    if not stream:
        resp = await client.post("/v1/completions", json=body, timeout=timeout_s)
        out = Outcome(resp.status_code, request_id=resp.headers.get("x-request-id", ""))
        data = resp.json()
        if resp.status_code == 200:
            out.text, out.finish_reason = data["choices"][0]["text"], data["choices"][0]["finish_reason"]
        else:
            out.error = data.get("error")
            if not isinstance(out.error, dict) or set(out.error) != {"message", "type", "param", "code"}:
                out.problems.append(f"error body not in the OpenAI shape: {data}")
        return out
    async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as resp:
        out = Outcome(resp.status_code, request_id=resp.headers.get("x-request-id", ""))
        if resp.status_code != 200:
            out.error = json.loads(await resp.aread()).get("error")
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if out.done:
                out.problems.append(f"data after [DONE]: {line}")
            payload = line[len("data: "):]
            if payload == "[DONE]":
                out.done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            for choice in chunk.get("choices", []):
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if not out.done:
            out.problems.append("the stream did not end with [DONE]")
        return out


def failed(out: Outcome) -> bool:
    return out.error is not None
