"""The shapes of the GPU run's microbenchmarks (gpu_kernels.py, quant_layers.py), as data: gpu_summary.py lists the
rows of a run that has not measured them yet from here, without importing torch. `dry`: the CPU dry run's shapes."""
from __future__ import annotations

# heads, kv heads, head dim, hidden, kv width (k or v), vocab: Llama-3-8B, and the dry run's tiny shapes
SHAPES = {False: dict(heads=32, kv_heads=8, head_dim=128, hidden=4096, kv=1024, vocab=128256),
          True: dict(heads=4, kv_heads=2, head_dim=32, hidden=64, kv=32, vocab=1000)}
# (name, [(cached tokens, new tokens) per sequence]): new == 1 is a decode
ATTENTION = {
    False: [("decode, batch 1 x context 4096", [(4095, 1)]),
            ("decode, batch 64 x context 1024", [(1023, 1)] * 64),
            ("decode, batch 256 x context 512", [(511, 1)] * 256),
            ("prefill, 1 x 2048 fresh tokens", [(0, 2048)]),
            ("prefill, 4 x 512 new tokens after 1024 cached", [(1024, 512)] * 4),
            ("mixed, 32 decodes (context 1024) + a 512-token chunk", [(1023, 1)] * 32 + [(0, 512)])],
    True: [("decode, 2 seqs x context 40", [(39, 1), (30, 1)]),
           ("prefill, 24 new tokens after 8 cached", [(8, 24)])],
}
# (kind, slots, tokens, seed): "bgmv" = the fused decode kernels, "seg" = segmented shrink + expand; "bgmv" at 512
# tokens is a prefill chunk in a mixed-step graph, beside the segmented kernels' same case (the eager path)
LORA = {False: [("bgmv", 8, 1, 0), ("bgmv", 8, 64, 1), ("bgmv", 32, 64, 2), ("bgmv", 32, 256, 3),
                ("seg", 8, 512, 4), ("bgmv", 8, 512, 4), ("seg", 32, 2048, 5)],
        True: [("seg", 2, 8, 0), ("bgmv", 2, 4, 1)]}
LORA_RANK = {False: 16, True: 8}
BITMASK_BATCHES = {False: [1, 64, 256], True: [2]}

QUANT_FORMATS = ("bf16", "w4a16", "w8a16", "fp8")
# issue 35's Llama-3-8B shapes (in, out): gate / up, down, q / o, k / v
QUANT_LAYERS = {False: {"up": (4096, 14336), "down": (14336, 4096), "o": (4096, 4096), "kv": (4096, 1024)},
                True: {"qkv": (256, 128), "down": (384, 64)}}
QUANT_TOKENS = {False: (1, 16, 64, 256, 1024), True: (1, 16)}


def attention_name(name: str) -> str:
    return f"paged attention: {name}"


def lora_name(kind: str, slots: int, tokens: int, rank: int) -> str:
    family = "LoRA fused decode (BGMV)" if kind == "bgmv" else "LoRA shrink + expand"
    return f"{family}: q/k/v r{rank}, {slots} slots x {tokens} tokens"


def bitmask_name(batch: int, vocab: int) -> str:
    return f"grammar bitmask apply: batch {batch} (every 2nd row constrained), vocab {vocab}"


def kernel_names(dry: bool) -> list[str]:
    """The kernel stage's rows, in its order."""
    rank, vocab = LORA_RANK[dry], SHAPES[dry]["vocab"]
    return ([attention_name(n) for n, _ in ATTENTION[dry]] + [lora_name(k, s, t, rank) for k, s, t, _ in LORA[dry]]
            + [bitmask_name(b, vocab) for b in BITMASK_BATCHES[dry]])
