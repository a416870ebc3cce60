"""Which launch the W4A16 / W8A16 GEMM (triton_gemm.py) makes for a token count and a layer shape: a fixed table.

    plan = gemm_plan(num_tokens, in_features, out_features, num_bits, group_size)   # None: the torch path
    plan.grid(num_tokens, out_features)

The table is keyed by the token-count bucket, then the layer shape: every token count of a bucket gets the same
tile constants and split-K for a given layer, so the variants are few, the warm-up (warmup.py) compiles each one
(one token count per bucket, `BUCKET_TOKENS`), and a CUDA graph replays what was captured.

Buckets (token counts T; the floor: the packed weight read once, int4 of a 4096 x 14336 layer = 29 MB):
- T <= 16 (decode): 16-token tiles, 256 input columns a step (int4: one 128-byte line of packed words per output
  row), split-K so a layer launches about `TARGET_PROGRAMS` programs (two per SM of an H100's 132): a 4096 -> 1024
  layer has only 16 tiles of 64 output rows, one program per tile would leave 116 SMs idle while 16 walk K.
- 16 < T <= 64 and 64 < T <= 256: GEMM tilings (64 x 64 then 128 x 128 output tiles), split-K by the same rule.
- 256 < T < DEQUANT_MIN_TOKENS: the 128 x 128 tiling. T >= DEQUANT_MIN_TOKENS: the weight is dequantized once
  into a scratch buffer of the model dtype and cuBLAS multiplies it (`kind` "dequant").
Split-K partials: each split writes an fp32 [T, N] slice of a [splits, T, N] buffer and a second, tiny launch sums
the slices in split order and casts them. By bytes it costs what atomics cost (the same 4 x splits x T x N bytes,
L2-resident: at most 16 x 16 x 14336 x 4 = 15 MB where N is that large, and splits are 1 there), and it is
deterministic (atomic adds land in any order: the same request would give different bits run to run, which
greedy parity and batch invariance forbid); atomics would also need the buffer zeroed (a launch either way).
Dequantize-once by bytes and FLOPs (H100: ~3 TB/s, ~800 TFLOP/s bf16): it writes and reads 2 bytes per weight
and reads the packed 0.5, i.e. 4.5 x N x K bytes more than the fused kernel (a 4096 x 14336 layer: ~88 us), so it
only wins where the fused kernel's compute loss against cuBLAS (Triton's dequantizing mainloop, taken as ~25%)
exceeds that: 2 T N K / 800e12 x 0.33 >= 88 us -> T >= ~1000 whatever the shape. At T = 256 it would cost about
twice the bf16 GEMM, so the fused 128 x 128 tiling serves 256 <= T < 1024. These are estimates on paper: the GPU
ratios are measured by benchmarks/quant_layers.py.
Act-order (`g_idx`) layers never reach the kernel with a gather: QuantLinear.finalize sorts their input columns
by group once at load (act_order.py); layers whose groups cannot be made contiguous take the torch path.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

NUM_SMS = 132                 # an H100 SXM: the table is fixed (the same on every device, and in the tests)
TARGET_PROGRAMS = 2 * NUM_SMS
MAX_SPLIT_K = 16
DEQUANT_MIN_TOKENS = 1024     # from here: dequantize once, then cuBLAS (see above)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int              # input columns a step (int8: 128, the same 128 bytes a row as int4's 256)
    num_warps: int
    num_stages: int


# (largest token count of the bucket, tiles for 4-bit, tiles for 8-bit); the last bucket is unbounded
TABLE: tuple[tuple[int, Tiles, Tiles], ...] = (
    (16, Tiles(16, 64, 256, 4, 3), Tiles(16, 64, 128, 4, 3)),
    (64, Tiles(64, 64, 128, 4, 3), Tiles(64, 64, 128, 4, 3)),
    (256, Tiles(128, 128, 64, 8, 3), Tiles(128, 128, 64, 8, 3)),
    (1 << 62, Tiles(128, 128, 64, 8, 3), Tiles(128, 128, 64, 8, 3)),
)
BUCKET_TOKENS = (1, 17, 65, 257, DEQUANT_MIN_TOKENS)   # one token count per launch variant (warmup.py)


@dataclass(frozen=True)
class Plan:
    kind: str                 # "fused": the dequantizing GEMM; "dequant": dequantize once + cuBLAS
    tiles: Tiles
    groups_per_tile: int      # scale groups inside one BLOCK_K step (1 when a group spans >= BLOCK_K columns)
    split_k: int
    k_per_split: int          # input columns per split, a multiple of block_k (and of a group spanning steps)
    group_step: int = 0       # > 0: a group spans several K steps; its scale and zero are loaded once per this
                              # many columns (the group size; per channel: the split), outside the steps

    def grid(self, num_tokens: int, out_features: int) -> tuple[int, int, int]:
        """(output-row tiles, splits, token tiles) of the fused kernel."""
        t = self.tiles
        return (-(-out_features // t.block_n), self.split_k, -(-num_tokens // t.block_m))

    def num_programs(self, num_tokens: int, out_features: int) -> int:
        n, s, m = self.grid(num_tokens, out_features)
        return n * s * m


def _block_k(block_k: int, group_size: int, in_features: int) -> tuple[int, int] | None:
    """(block_k, groups per tile) with the tile's groups whole, or None (a group size the kernel cannot tile)."""
    if group_size >= in_features:                        # per channel: one group, any K
        return block_k, 1
    if group_size % block_k == 0:
        return block_k, 1
    if block_k % group_size == 0 and group_size >= 16 and group_size & (group_size - 1) == 0:
        return block_k, block_k // group_size
    bk = group_size & -group_size                        # the largest power of two dividing the group size
    return (bk, 1) if bk >= 16 else None


def bucket_tiles(num_tokens: int, num_bits: int) -> Tiles:
    for top, t4, t8 in TABLE:
        if num_tokens <= top:
            return t4 if num_bits == 4 else t8
    raise AssertionError("the last bucket is unbounded")


@lru_cache(maxsize=4096)
def gemm_plan(num_tokens: int, in_features: int, out_features: int, num_bits: int,
              group_size: int) -> Plan | None:
    """The launch for x [num_tokens, in] through a quantized [out, in] weight; None: the kernel cannot serve it."""
    if num_bits not in (4, 8) or in_features % (32 // num_bits):   # whole int32 words per row
        return None
    tiles = bucket_tiles(num_tokens, num_bits)
    fit = _block_k(tiles.block_k, group_size, in_features)
    if fit is None:
        return None
    block_k, groups_per_tile = fit
    tiles = Tiles(tiles.block_m, tiles.block_n, block_k, tiles.num_warps, tiles.num_stages)
    kind = "dequant" if num_tokens >= DEQUANT_MIN_TOKENS else "fused"
    num_k_steps = -(-in_features // block_k)
    split = 1
    # >= 2 steps of K per split; the bucket's largest token count fixes it (the same for every T of the bucket)
    bucket_m = -(-min(next(top for top, *_ in TABLE if num_tokens <= top), DEQUANT_MIN_TOKENS) // tiles.block_m)
    tiles_mn = -(-out_features // tiles.block_n) * bucket_m if kind == "fused" else 0
    while tiles_mn and split < MAX_SPLIT_K and tiles_mn * split < TARGET_PROGRAMS and num_k_steps >= 4 * split:
        split *= 2
    steps_per_split = -(-num_k_steps // split)
    per_channel = group_size >= in_features
    hoist = groups_per_tile == 1 and (per_channel or group_size > block_k)
    if hoist and not per_channel:                        # splits end on group boundaries
        steps_per_group = group_size // block_k
        steps_per_split = -(-steps_per_split // steps_per_group) * steps_per_group
    split = -(-num_k_steps // steps_per_split)           # no empty split
    k_per_split = steps_per_split * block_k
    group_step = (k_per_split if per_channel else group_size) if hoist else 0
    return Plan(kind, tiles, groups_per_tile, split, k_per_split, group_step)
