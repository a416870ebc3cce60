"""Quantized base models: detection (config), packed layouts (packing, formats), the layer (linear), loading."""
from core.quant.config import METHODS, QuantScheme, UnsupportedQuantization, detect_quantization

__all__ = ["METHODS", "QuantScheme", "UnsupportedQuantization", "detect_quantization"]
