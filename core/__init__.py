"""loraplex engine core: paged KV cache, radix prefix cache, continuous batching."""
from core.engine.llm import LLM
from core.engine.outputs import CompletionOutput, RequestOutput
from core.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
