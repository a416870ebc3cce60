"""A request body -> engine inputs: sampling params and defaults, penalties, constraints, prompts, model names."""
