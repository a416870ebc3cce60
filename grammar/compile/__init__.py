"""Compilation in killable worker processes: the pool, the worker, the compiler's cache, the vocabulary."""
