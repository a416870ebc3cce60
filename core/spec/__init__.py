"""Speculative decoding: proposers (n-gram, draft model), verification by rejection sampling, metrics."""
from core.spec.config import SpeculativeConfig, SpeculativeConfigError

__all__ = ["SpeculativeConfig", "SpeculativeConfigError"]
