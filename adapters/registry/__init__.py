"""Which adapters exist: names, generations, refcounts, the host LRU, `--lora-dir` folders, the loader pool."""
