"""Multi-LoRA support: PEFT loading (peft_loader), device slots (slots), batched LoRA ops
(lora_ops) and the wrappers of the base model's fused linears (layers)."""
