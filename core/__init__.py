"""loraplex engine core: paged KV cache, radix prefix cache, continuous batching."""
from core.llm import LLM
from core.outputs import CompletionOutput, RequestOutput
from core.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
