"""The request's output constraint (response_format, structured_outputs, guided_*, tools) -> a compiled grammar
(opaque here: `CompiledConstraint`; the gateway only hands it to the engine, a matcher per child)."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from core.engine.interface import CompiledConstraint, ServingEngine
from gateway.errors import invalid
from gateway.inputs import tokenize_pool
from gateway.protocol import _SamplingFields
from gateway.tools.tools import ToolPlan
from grammar.schema.lowering import SchemaOptions, warm_validators
from grammar.specs.constraints import GUIDED_FIELDS, parse_constraints
from grammar.specs.spec import GrammarSpec
from grammar.matching.triggered import triggered_grammar
from grammar.specs.tool_calls import tool_calls_spec


def constraint_spec(body: _SamplingFields, options: SchemaOptions) -> GrammarSpec | None:
    """Admission (synchronous, cheap): the one GrammarSpec of the body, or None; GrammarError -> 400.
    `options`: the engine's schema lowering limits (`EngineFacts.schema_options`)."""

    rf = body.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
        raise invalid("response_format.json_schema is required when type is 'json_schema'",
                      param="response_format.json_schema")
    if not wants_constraint(body):
        return None   # free text: never touches the engine
    rf_dict = None if rf is None else rf.model_dump(by_alias=True, exclude_none=True)
    guided = {name: getattr(body, name) for name in GUIDED_FIELDS}
    return parse_constraints(body.structured_outputs, guided, rf_dict, options, body.guided_whitespace_pattern)


def wants_constraint(body: _SamplingFields) -> bool:
    rf = body.response_format
    return not ((rf is None or rf.type == "text") and body.structured_outputs is None
                and body.guided_whitespace_pattern is None
                and all(getattr(body, name) is None for name in GUIDED_FIELDS))


_validators_ready = False


async def validators_ready(engine: ServingEngine | None = None) -> None:
    """jsonschema is imported on first use (with its optional format packages that takes seconds): the first
    request that needs schema checks loads it on a worker thread, so the event loop never stalls on it. With
    `engine`, its compile workers import the schema lowering (jsonschema too) at the same time."""
    global _validators_ready
    if engine is not None:
        engine.grammar_compiler.warm_lowering()
    if not _validators_ready:
        await asyncio.to_thread(warm_validators)
        _validators_ready = True


async def _compiled(future: "concurrent.futures.Future[Any]") -> Any:
    """Awaits a compiler future. Cancelling the caller (its client went away) leaves the compile alone: it may
    be shared with other requests (de-duplicated in flight), and its result is still cached for the next one."""
    wrapped = asyncio.wrap_future(future)
    try:
        return await asyncio.shield(wrapped)
    except asyncio.CancelledError:
        wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())   # an error nobody reads: no warning
        raise


async def compile_spec(spec: GrammarSpec | None, engine: ServingEngine) -> CompiledConstraint | None:
    """Off the event loop: the compiler's workers (timeout, de-dup, cache); a failure is a GrammarError (400)."""
    if spec is None:
        return None
    return await _compiled(engine.grammar_compiler.submit(spec))


async def admit_constraint(body: _SamplingFields, engine: ServingEngine) -> GrammarSpec | None:
    """`constraint_spec` off the event loop: its schema checks are linear in the schema but not free (the
    metaschema validation of a 256 KB schema takes most of a second), so they run on a tokenizer thread."""
    if not wants_constraint(body):
        return constraint_spec(body, engine.facts.schema_options)   # the cheap checks of a body without one
    return await tokenize_pool.run(constraint_spec, body, engine.facts.schema_options)


async def check_tool_schemas(plan: ToolPlan | None, engine: ServingEngine) -> None:
    """Every tool's `parameters` lowered in a compile worker (callable or not, also with tool_choice "none"):
    a schema the lowering refuses is a 400 naming `tools[i].function.parameters` before the prompt is rendered,
    as when admission lowered them. Remembered per tool set (`GrammarCompiler.check`)."""
    if plan is None or not plan.checked:
        return

    await _compiled(engine.grammar_compiler.check(
        tool_calls_spec(plan.fmt, [], plan.parallel, checked=plan.checked)))


async def resolve_tool_constraint(body: _SamplingFields, engine: ServingEngine,
                                  plan: ToolPlan | None) -> CompiledConstraint | None:
    """The compiled call grammar of a tool plan (`required`/named: whole output; `auto`: trigger-then-grammar),
    or the request's other constraint; a tool constraint together with another one -> 400."""
    other = await admit_constraint(body, engine)
    if plan is None or not plan.constrained:
        return await compile_spec(other, engine)
    if other is not None:
        raise invalid(f"a request may carry only one output constraint: tool_choice {plan.choice!r} with "
                      f"{other.param or 'response_format'}", param=other.param or "response_format")
    auto = plan.choice == "auto"
    spec = tool_calls_spec(plan.fmt, plan.functions, plan.parallel, after_trigger=auto, checked=plan.checked,
                           markers=plan.marker_ids)
    compiled = await compile_spec(spec, engine)
    if not auto:
        return compiled
    return await asyncio.to_thread(triggered_grammar, compiled, engine.grammar_compiler.vocab, plan.fmt.triggers,
                                   plan.trigger_id)
