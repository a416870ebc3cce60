"""Running a step on the device: the flat batch and model call, CUDA graphs, pending tokens, LoRA step work."""
