"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA), and the single rank as its size 1.

Every engine runs on an executor of `tensor_parallel_size` ranks. The scheduler, radix cache, grammar and
gateway stay in the server process, which is also rank 0 (the driver: it runs its own shard of the model in
the engine thread, as vLLM's driver worker does). Ranks 1..N-1 are worker processes (`worker.py`) that receive
each step's inputs from the driver (`executor.py`) and run their shard in lock step; only rank 0 gets the
gathered logits and samples. At N=1 there is no worker and no process group: the shard is the whole model, the
collectives return at once, and the same loader, LoRA pool and engine parts serve.

    parallel_state.py   process groups (device group for activations, gloo group for step messages)
    shard.py            which slice of every weight a rank holds; divisibility checks
    weights.py          the weight loader: a rank's slices of a safetensors checkpoint
    layers.py           column / row / vocabulary parallel modules swapped in when the model is built
    lora.py             sharded LoRA (S-LoRA): slot pool that mirrors its writes, row-parallel wrapper
    rank_state.py       what every rank builds: model shard (the one model loader), LoRA pool, KV pool
    step_inputs.py      one step's inputs as the driver broadcasts them
    worker.py           the worker process loop
    executor.py         the driver side: spawn, step broadcast, liveness monitor, shutdown
"""
