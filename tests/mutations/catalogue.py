"""The bugs tests/mutations/mutation_check.py plants, one at a time, on the paths that matter most, and the test
files that must catch each.

A mutation is a list of exact text edits (each `old` must occur exactly once in its file, so a refactor that
moves the code makes the check fail loudly instead of planting nothing). Keep `tests` to the files that
exercise the path: the check runs only those, so it stays minutes, not hours.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    path: str   # relative to the repository root
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    description: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]   # test files (or node ids) that must catch it


LORA_PARITY_TESTS = (
    "tests/test_core/models/test_family_qwen3.py",
    "tests/test_core/models/test_family_gemma.py",
    "tests/test_core/models/test_family_phi3.py",
    "tests/test_core/models/test_rope_scaling.py",
    "tests/test_core/models/test_sliding_window.py",
    "tests/test_core/quant/test_quant_ct.py",
    "tests/test_core/quant/test_quant_gptq_awq.py",
    "tests/test_core/quant/test_quant_phi3.py",
    "tests/test_core/quant/test_quant_fp8.py",
    "tests/test_core/quant/test_quant_tp.py",
    "tests/test_core/quant/test_quant_server.py",
    "tests/test_core/engine/test_fault_isolation.py",
    "tests/test_gateway/robustness/test_server_faults.py",
    "tests/test_gateway/robustness/test_soak_faults.py",
    "tests/test_adapters/test_lora_engine.py",
    "tests/test_core/spec/test_spec_lora.py",
)
GRAMMAR_TESTS = (
    "tests/test_grammar/test_matcher.py",
    "tests/test_core/sampling/test_structured_engine.py",
    "tests/test_core/engine/test_fault_isolation.py",
)
PENALTY_TESTS = ("tests/test_core/sampling/test_penalties.py",)
STOP_TESTS = (
    "tests/test_core/sampling/test_sampling.py",
    "tests/test_core/sampling/test_detokenizer_fields.py",
    "tests/test_core/sampling/test_stop_semantics.py",
)
FAULT_TESTS = ("tests/test_core/engine/test_fault_isolation.py",)
NAMESPACE_TESTS = ("tests/test_adapters/test_lora_engine.py",)

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "lora-slot1-expand", "the CPU LoRA path skips the adapter in device slot 1 (its delta never reaches the output)",
        (Edit("adapters/lora_ops/torch_grouped.py",
              "    for g, slot in enumerate(meta.group_slots_host):\n        if ranks[slot]:\n",
              "    for g, slot in enumerate(meta.group_slots_host):\n        if ranks[slot] and slot != 1:\n"),
         Edit("adapters/lora_ops/torch_grouped.py",
              "    for first, size, slot in runs:\n",
              "    for first, size, slot in (run for run in runs if run[2] != 1):\n"),
         Edit("adapters/lora_ops/torch_grouped.py",
              "    for slot, start, size, first, contiguous in groups:\n",
              "    for slot, start, size, first, contiguous in (g for g in groups if g[0] != 1):\n")),
        LORA_PARITY_TESTS),
    Mutation(
        "lora-rslora-scaling", "rsLoRA scaled by alpha / r instead of alpha / sqrt(r)",
        (Edit("adapters/peft/config.py", "return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank",
              "return alpha / rank"),),
        ("tests/test_adapters/test_lora_engine.py", "tests/test_core/models/test_family_qwen3.py")),
    Mutation(
        "grammar-mask-wrong-row", "each constrained request's bitmask is written at its index among the constrained "
        "rows, not at its row of the batch",
        (Edit("core/sampling/grammar_masks.py", "        reqs[i].grammar.fill_bitmask(bitmask, i)\n",
              "        reqs[i].grammar.fill_bitmask(bitmask, rows.index(i))\n"),),
        GRAMMAR_TESTS),
    Mutation(
        "grammar-eos-anywhere", "EOS allowed in every grammar state, not only in final ones",
        (Edit("grammar/matching/compiled.py", "            np.bitwise_and.at(words, eos >> 5, ~bits)\n",
              "            np.bitwise_or.at(words, eos >> 5, bits)\n"),
         Edit("grammar/matching/compiled.py", "                if self.is_final(state):\n"
              "                    ids = np.concatenate(", "                if True:\n                    ids = np.concatenate(")),
        GRAMMAR_TESTS),
    Mutation(
        "fault-token-handling-fails-step", "a request whose token handling raises fails the whole step "
        "(every request in it) instead of itself",
        (Edit("core/engine/engine.py", "                out.append(self._fail(r, fault_of(r, \"token handling\", exc)))\n",
              "                raise\n"),),
        FAULT_TESTS),
    Mutation(
        "fault-sampling-rows-shift", "after a row fails in the sampling stage, the kept rows' tokens are written "
        "in order from row 0 (rows after the failed one take a neighbour's token)",
        (Edit("core/sampling/stage.py", "        tokens.index_copy_(0, idx, kept_tokens)\n",
              "        tokens[:len(keep)] = kept_tokens\n"),),
        FAULT_TESTS),
    Mutation(
        "prefix-namespace-by-name", "the prefix-cache namespace of an adapter is its name, not its generation id "
        "(a reload under the same name reuses the old weights' KV)",
        (Edit("adapters/registry/registry.py", "    def namespace(self) -> str:\n        return self.generation_id\n",
              "    def namespace(self) -> str:\n        return self.name\n"),),
        NAMESPACE_TESTS),
    Mutation(
        "prefix-namespace-shared", "every request uses the base model's prefix-cache namespace (adapters reuse the "
        "base model's KV)",
        (Edit("core/scheduling/admission.py",
              'salted(lora.namespace if lora is not None else "base", params.cache_salt)',
              'salted("base", params.cache_salt)'),),
        NAMESPACE_TESTS),
    Mutation(
        "prefix-cache-salt-ignored", "cache_salt changes no namespace (salted requests share the unsalted KV)",
        (Edit("core/scheduling/admission.py", "    if cache_salt is None:\n        return namespace\n",
              "    return namespace\n"),),
        ("tests/test_core/kv/test_cache_salt.py",)),
    Mutation(
        "penalty-repetition-inverted", "repetition penalty multiplies positive logits and divides negative ones",
        (Edit("core/sampling/penalties.py", "torch.where(x > 0, x / batch.repetition, x * batch.repetition)",
              "torch.where(x > 0, x * batch.repetition, x / batch.repetition)"),),
        PENALTY_TESTS),
    Mutation(
        "penalty-frequency-as-presence", "frequency penalty applied once per seen token, not per occurrence",
        (Edit("core/sampling/penalties.py", "x.sub_(counts * batch.frequency)", "x.sub_(in_output * batch.frequency)"),),
        PENALTY_TESTS),
    Mutation(
        "penalty-min-tokens-off", "min_tokens bans nothing: EOS and stop tokens can end the output early",
        (Edit("core/sampling/penalties.py", "        if r.num_output_tokens < p.min_tokens:\n",
              "        if False:\n"),),
        PENALTY_TESTS),
    Mutation(
        "stop-string-across-tokens", "a stop string is searched for only in the text of the newest token (one that "
        "spans two tokens is missed)",
        (Edit("core/sampling/detokenizer.py", "self.text.find(s, max(0, old_len - len(s) + 1))",
              "self.text.find(s, old_len)"),),
        STOP_TESTS),
    Mutation(
        "stop-string-kept", "the matched stop string stays in the output text",
        (Edit("core/sampling/detokenizer.py",
              "self.text = self.text[:start + length] if self._include_stop else self.text[:start]",
              "self.text = self.text[:start + length]"),),
        STOP_TESTS),
    Mutation(
        "stop-token-text-kept", "the EOS or stop token that ends an answer adds its text (vLLM leaves it out unless "
        "include_stop_str_in_output)",
        (Edit("core/sampling/stops.py", "        if params.include_stop_str_in_output:\n            _detokenize(",
              "        if True:\n            _detokenize("),),
        STOP_TESTS),
    Mutation(
        "grammar-stop-token-text-dropped", "under a grammar, the stop token that ends the answer adds no text even "
        "with include_stop_str_in_output",
        (Edit("core/sampling/stops.py", "            if params.include_stop_str_in_output:   # its text all the same",
              "            if False:   # its text all the same"),),
        STOP_TESTS),
    Mutation(
        "stop-string-window-shared", "every stop string is searched as far back as the longest one reaches (a short "
        "one that ended within min_tokens matches on the next token)",
        (Edit("core/sampling/detokenizer.py", "max(0, old_len - len(s) + 1)", "max(0, old_len - self._search_back)"),),
        STOP_TESTS),
    Mutation(
        "min-tokens-stop-strings", "stop strings end the text within min_tokens (vLLM does not look for them there)",
        (Edit("core/sampling/stops.py", "check_stops and req.num_output_tokens > req.sampling_params.min_tokens",
              "check_stops"),),
        STOP_TESTS),
    Mutation(
        "spaces-between-special-tokens-dropped", "the gateway drops `spaces_between_special_tokens: false` (the "
        "engine always spaces adjacent added tokens)",
        (Edit("gateway/inputs/params.py",
              "spaces_between_special_tokens=body.spaces_between_special_tokens is not False,",
              "spaces_between_special_tokens=True,"),),
        ("tests/test_gateway/api/test_vllm_request_fields.py::"
         "test_spaces_between_special_tokens_joins_adjacent_added_tokens",)),
    Mutation(
        "spec-accept-ignores-draft-probs", "speculative rejection sampling accepts a drafted token with probability "
        "p(x), not min(1, p(x) / q(x))",
        (Edit("core/spec/rejection.py", "accept = u_accept * q_x.double() < p_x.double()",
              "accept = u_accept < p_x.double()"),),
        ("tests/test_core/spec/test_spec_rejection.py",)),
    Mutation(
        "responses-item-keys-unchecked", "a Responses input item's unknown keys are silently dropped",
        (Edit("gateway/routes/responses_api.py", "        if isinstance(kind, str) and kind in _ITEM_KEYS:\n",
              "        if False:\n"),),
        ("tests/test_gateway/api/test_responses_api.py::test_unknown_keys_in_input_items_and_format_are_400",)),
    Mutation(
        "responses-call-own-turn", "function_call items after an assistant message item become a second assistant "
        "turn",
        (Edit("gateway/routes/responses_api.py", 'if last is not None and last["role"] == "assistant" and not reasoning:',
              'if last is not None and last["role"] == "assistant" and "tool_calls" in last and not reasoning:'),),
        ("tests/test_gateway/api/test_responses_api.py::test_message_then_function_call_items_are_one_assistant_turn",)),
    Mutation(
        "responses-logprobs-keep-reasoning", "a Responses message's logprobs include the reasoning's tokens (and "
        "`</think>`) under --reasoning-parser",
        (Edit("gateway/reasoning/reasoning_output.py", "rest = r.logprobs[splitter.num_reasoning_tokens:]",
              "rest = r.logprobs"),),
        ("tests/test_gateway/reasoning/test_reasoning.py::test_responses_logprobs_are_the_message_tokens_only",)),
    Mutation(
        "responses-stream-logprobs-keep-reasoning", "a streamed Responses message's logprobs include the reasoning's "
        "tokens under --reasoning-parser",
        (Edit("gateway/routes/responses_stream.py", "        if self.info.reasoning is not None:\n",
              "        if False:\n"),),
        ("tests/test_gateway/reasoning/test_reasoning.py::test_responses_logprobs_are_the_message_tokens_only",)),
    Mutation(
        "responses-stream-text-logprobs-dropped", "streamed response.output_text.delta events carry no logprobs",
        (Edit("gateway/routes/responses_stream.py", "for b in ev.text(chunk, logprobs=pending.take()):",
              "for b in ev.text(chunk):"),),
        ("tests/test_gateway/api/test_responses_fields.py::test_streamed_logprobs_on_the_text_events",)),
    Mutation(
        "sampler-top-p-off", "top_p is ignored (the whole distribution is sampled)",
        (Edit("core/sampling/sampler.py", "need_top_p=any(p.top_p < 1.0 for p in ps)", "need_top_p=False"),),
        ("tests/test_core/sampling/test_sampling.py",)),
    Mutation(
        "sampler-top-p-holds-min-p", "the step's top_p vector also holds the min_p values (min_p with top_p fails)",
        (Edit("core/sampling/sampler.py", "top_ps=floats[n:2 * n]", "top_ps=floats[n:]"),),
        ("tests/test_core/sampling/test_batch_invariance.py",)),
    Mutation(
        "sampler-top-p-trims-top-p-1-rows", "a row with top_p 1 goes through the float32 cumsum filter when another "
        "row sets top_p",
        (Edit("core/sampling/sampler.py", " & (batch.top_ps < 1.0)[:, None]", ""),),
        ("tests/test_core/sampling/test_batch_invariance.py",)),
    Mutation(
        "sampler-unstable-sort", "equal logits at the top-k / top-p boundary are kept in the sort kernel's order",
        (Edit("core/sampling/sampler.py", "x.sort(dim=-1, descending=True, stable=True)",
              "x.sort(dim=-1, descending=True)"),),
        ("tests/test_core/sampling/test_batch_invariance.py",)),
    Mutation(
        "logprobs-topk-ties-by-kernel", "top logprobs break ties as topk does for the batch's largest k",
        (Edit("core/sampling/sampler.py", "    vals, ids = ranked_topk(logp, num_top)",
              "    vals, ids = logp.topk(min(max(num_top, 0), logp.shape[-1]), dim=-1)"),),
        ("tests/test_core/sampling/test_batch_invariance.py",)),
)
