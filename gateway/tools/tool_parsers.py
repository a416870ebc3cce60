"""vLLM's `--tool-call-parser` names -> our tool-call families (grammar/specs/tool_calls.py `FORMATS`).

Every family we implement is a parser of its own name; vLLM registers `llama4_json` as a second name of its
`llama3_json` parser. Kept apart from gateway/tools/tools.py so that parsing the command line stays light.
"""
from __future__ import annotations

from grammar.specs.tool_calls import FORMATS, ToolCallFormat

_ALIASES = {"llama4_json": "llama3_json"}
TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {
    **FORMATS, **{alias: FORMATS[name] for alias, name in _ALIASES.items() if name in FORMATS}}
