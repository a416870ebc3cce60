"""Device slots: `max_loras` slots of stacked LoRA weights and how they are filled."""
