"""Sampling: parameters, the batched sampler, penalties, grammar masks, prompt logprobs, stops, detokenizing."""
