"""Scheduling: the per-step scheduler, the waiting queue, tenant fairness, admission and context limits."""
