"""The engine: `LLMEngine` and its step, its setup, the async loop, the offline `LLM`, requests and outputs."""
