"""How LoRA attaches to a model built without it: the base dimensions, the wrapped linears, the step context."""
