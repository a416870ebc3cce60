"""Reading PEFT adapters: `adapter_config.json` validation and the weights, checked against the base model."""
