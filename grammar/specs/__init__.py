"""Request formats -> a GrammarSpec: response_format, vLLM's constraint spellings, tool calls."""
