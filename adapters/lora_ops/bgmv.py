"""Fused multi-LoRA for decode batches (BGMV): per-row slot metadata and the launchers of its kernels.

A decode step has one token per row. `DecodeLoRAMeta` holds, in persistent device buffers refilled every
step, each row's slot (-1 = base), the rows sorted by slot and the rows grouped by slot (groups of at most
BLOCK_M rows of one adapter); the kernels' grids depend only on the padded batch size and the pool, so a CUDA
graph captured once serves every adapter mix. The mixed-step graphs (`core/execution/mixed_graphs.py`) run their
prefill chunks through these kernels too, one token a row; eager prefill and mixed steps take the segmented path
(`metadata.LoRABatchMeta`, `triton_ops`).

    meta = DecodeLoRAMeta.build(slots, device)     # or GraphLoRABuffers(...).meta(B): persistent buffers
    bgmv_add_lora(y, x, stack, meta)          # y[T, out] += LoRA(x[T, in]) for every row with a slot

`triton_bgmv_add_lora` is `triton_bgmv_shrink` then `triton_bgmv_expand`; the row-parallel LoRA of tensor
parallelism all-reduces the shrink result between the two (`bgmv_split`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from adapters.lora_ops.stack import LoRAStack
from adapters.lora_ops.torch_ops import torch_add_lora_rows

# the latency model of `choose_config` (docs/lora_kernels.md), fitted to the H200's sweep of decode configs
# (results/gpu_run_h200_2026-11-27c/kernels.json "sweep": q/k/v, gate/up and down at 64 and 256 rows over 8 and 32
# adapters, pools of rank 16 and 64, tiles of TILE_OPTIONS, 106 configs, mean error 11%; the earlier run's 40
# configs, not fitted: 12%): a launch pair takes a latency per tile iteration of its longest shrink and expand
# programs (the loads of a program are a chain of dependent latencies: the bytes, ~3 MB a launch, are under a
# microsecond of HBM time), a wider tile a little more per iteration (per 1,024 values of its A or B tile), a
# latency per extra load of K-split partials, a cost per program of each grid (empty ones too), and a fixed cost
# (refit: benchmarks/fit_bgmv_model.py)
SHRINK_ITERATION_US = 0.74
SHRINK_US_PER_KVALUES = 0.133      # per 1,024 values of an A tile (BLOCK_K x BLOCK_R), per iteration
EXPAND_ITERATION_US = 0.66
EXPAND_US_PER_KVALUES = 0.287      # per 1,024 values of a B tile (BLOCK_R x BLOCK_N), per iteration
PARTIALS_LOAD_US = 6.8             # each load of partials past the first (more than splits_per_load splits)
SHRINK_PROGRAM_US = 0.0059
EXPAND_PROGRAM_US = 0.0085
LAUNCH_PAIR_US = 6.10
SPLIT_OPTIONS = (1, 2, 4, 8, 16, 32)
CHUNK_OPTIONS = (1, 2, 4, 8, 16, 32, 64)
# (BLOCK_K, BLOCK_N) of the compiled kernels, the sweep's tiles: fewer, wider iterations beat more splits of narrow
# ones (q/k/v at 64 rows over 8 rank-16 adapters: 17.2 us at 256 x 256, 21.6 us at the best 64 x 64 config); an A
# or B tile holds at most MAX_TILE_VALUES values (a rank-64 pool: 256 columns; at 512 x 256 it ran 2.7x slower).
# The sweep ran bf16 weights: fp32 ones (tests, --dtype float32) keep the first, whose tl.dot operands fit the
# shared memory at any rank the pool takes
TILE_OPTIONS = ((64, 64), (128, 128), (256, 128), (256, 256))
MAX_TILE_VALUES = 16384
# and at most this share of the device's shared memory a block (`max_tile_bytes`): Triton's software pipeline keeps
# up to three stages of a tile there, so a 256 x 64 bf16 A tile (32 KiB) fits a Hopper's or an A100's 164-227 KiB,
# not the ~99 KiB of an A10, L4 or RTX 4090, which get 128-column tiles at rank 64 (not measured on those)
TILE_SHARED_MEMORY_SHARE = 4
# the tiles are fixed per stack (one compiled variant per fused linear, whatever the batch size): chosen at this
# many padded rows, a decode batch's typical size; the splits and chunks then follow each batch size
TILE_REFERENCE_ROWS = 64
INTERPRETER_TILE = 32     # the interpreter's BLOCK_K / BLOCK_N (speed); it keeps the GPU's splits and chunks
# K-split partials expand sums per load: one [splits_per_load(BLOCK_R), BLOCK_M, BLOCK_R] fp32 tile of at most
# PARTIALS_TILE values (32 registers a thread at 4 warps), so 16 splits of a rank-16 pool cost two dependent loads,
# not sixteen
PARTIALS_PER_LOAD = 8
PARTIALS_TILE = 4096
# rows of one group a program takes at a time (tl.dot's minimum): decode groups are mostly smaller (64 rows over 8+
# adapters); a larger group loops and re-reads its A/B tiles once per 16 rows. The default of every metadata; a
# metadata built with larger groups (`group_rows`, one of GROUP_ROWS_OPTIONS) runs the kernels with that BLOCK_M:
# a prefill chunk then reads its adapter's A and B once per `group_rows` of its tokens instead of once per 16
# (`benchmarks/gpu_kernels.py` times both; not measured yet, so nothing builds such metadata by default).
BLOCK_M = 16
GROUP_ROWS_OPTIONS = (16, 32, 64)


def aligned_rows(num_rows: int) -> int:
    """`num_rows` int32 entries rounded up to a multiple of 16 bytes: the offset of the next field of a packed
    metadata buffer, so every field's pointer has the same alignment whatever the batch size."""
    return -(-num_rows // 4) * 4


def decode_groups(slots: np.ndarray, max_rows: int = BLOCK_M) -> tuple[np.ndarray, np.ndarray]:
    """(rows sorted by slot with base rows last, groups [3, B]: slot, first position in the order, rows) of a
    batch's per-row slots. Each slot's rows are cut into groups of at most `max_rows` (consecutive in the order), so
    no program of the kernels walks more than that many rows: a prefill chunk of 1,000 tokens on one adapter is
    ~63 programs, not one that walks them in turn. Groups past the step's have slot -1 and 0 rows; there are at
    most `max_groups(B, num_slots)` of them."""
    slots = np.asarray(slots, dtype=np.int64)
    b = len(slots)
    order = np.argsort(np.where(slots >= 0, slots, np.iinfo(np.int64).max), kind="stable")
    groups = np.zeros((3, b), dtype=np.int64)                                   # [3, B]
    groups[0] = -1
    ordered = slots[order]                                                      # [B]
    live = ordered[ordered >= 0]
    if live.size:
        uniq, first, counts = np.unique(live, return_index=True, return_counts=True)      # [D] each
        pieces = -(-counts // max_rows)                                         # [D] groups of each slot
        owner = np.repeat(np.arange(uniq.size), pieces)                         # [G] slot index of each group
        piece = np.arange(owner.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)      # [G] index in its slot
        g = owner.size
        groups[0, :g] = uniq[owner]
        groups[1, :g] = first[owner] + piece * max_rows
        groups[2, :g] = np.minimum(max_rows, counts[owner] - piece * max_rows)
    return order, groups


def max_groups(num_rows: int, num_slots: int, max_rows: int = BLOCK_M) -> int:
    """The most groups `decode_groups` makes of `num_rows` rows over a pool of `num_slots`: the kernels' grid.
    Each of the d <= min(rows, slots) distinct slots with n rows makes ceil(n / max_rows) <= n // max_rows + 1
    groups, and every group holds a row."""
    return min(num_rows, num_rows // max_rows + min(num_rows, num_slots))


@dataclass(frozen=True)
class DecodeLoRAMeta:
    """Per-row LoRA slots of a (padded) decode batch: row i's token is x[i]; slot -1 rows get no LoRA.
    `groups` [3, num_tokens] int32 holds the rows grouped by slot, at most BLOCK_M rows a group (slot, first
    position in `row_order`, number of rows; unused groups have 0 rows), refilled every step with the rest
    (`graph_meta.GraphLoRABuffers`)."""

    num_tokens: int            # rows of the batch, padding included
    row_slots: torch.Tensor    # [num_tokens] int32, slot of each row (-1 = base)
    row_order: torch.Tensor    # [num_tokens] int32, the rows sorted by slot, base rows last
    groups: torch.Tensor       # [3, num_tokens] int32: group slot | first position in row_order | rows (<= group_rows)
    group_rows: int = BLOCK_M  # the most rows of a group (the kernels' BLOCK_M)

    def __post_init__(self) -> None:
        assert self.group_rows in GROUP_ROWS_OPTIONS, f"group_rows {self.group_rows} not in {GROUP_ROWS_OPTIONS}"

    @classmethod
    def build(cls, token_slots: Any, device: torch.device | str = "cpu",
              group_rows: int = BLOCK_M) -> "DecodeLoRAMeta":
        """The metadata of host per-row slots (one host-to-device copy; outside graphs: tests, warm-up). The fields
        start on 16-byte boundaries as in the graphs' persistent buffers (`graph_meta.GraphLoRABuffers`): Triton
        specializes pointers on that alignment, so the warm-up's launches on this metadata are the variants the
        graphs replay (and the ones its self-check compares)."""
        slots = np.asarray(torch.as_tensor(token_slots).cpu(), dtype=np.int64)
        order, groups = decode_groups(slots, group_rows)
        b = len(slots)
        bp = aligned_rows(b)
        packed = np.zeros(2 * bp + 3 * b, dtype=np.int32)                      # slots | order | groups, aligned
        packed[:b], packed[bp:bp + b], packed[2 * bp:] = slots, order, groups.ravel()
        dev = torch.from_numpy(packed).to(device)
        return cls(num_tokens=b, row_slots=dev[:b], row_order=dev[bp:bp + b],
                   groups=dev[2 * bp:].view(3, b), group_rows=group_rows)      # [3, B]

    @property
    def has_lora(self) -> bool:
        return True        # built only for steps with at least one LoRA row

    @property
    def device(self) -> torch.device:
        return self.row_slots.device

    def check_num_tokens(self, num_tokens: int) -> None:
        assert num_tokens == self.num_tokens, f"decode LoRA metadata for {self.num_tokens} rows, got {num_tokens}"


@dataclass(frozen=True)
class BGMVConfig:
    """Tiles and work split of one stack's decode kernels at one padded batch size: fixed per (stack, batch
    size), never per step, so a captured graph keeps its launches and no variant compiles mid-serving."""

    block_m: int
    block_r: int
    block_k: int
    block_n: int
    num_k_splits: int
    k_per_split: int
    num_n_chunks: int
    # warps a program and pipelining depth of both launches (None: Triton's defaults, 4 warps): what serving runs.
    # Other values are the kernels stage's sweep, asking whether more loads in flight shorten a latency-bound chain
    num_warps: int | None = None
    num_stages: int | None = None

    def launch_options(self) -> dict[str, int]:
        """The launch keywords these set (none by default: Triton's defaults)."""
        return {k: v for k, v in (("num_warps", self.num_warps), ("num_stages", self.num_stages)) if v is not None}


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def splits_per_load(block_r: int, block_m: int = BLOCK_M) -> int:
    """K-split partials one load of expand sums: PARTIALS_PER_LOAD, fewer for wide ranks or groups (PARTIALS_TILE
    values)."""
    return max(1, min(PARTIALS_PER_LOAD, PARTIALS_TILE // (block_m * block_r)))


def effective_splits(k_tiles: int, splits: int) -> int:
    """The K splits a launch runs when asked for `splits` over `k_tiles` tiles: every split takes the same whole
    number of tiles (`config_with_splits`), so 32 asked over 224 tiles run as 32 of 7, over 216 as 31 (30 of 7, the
    last of 6)."""
    return -(-k_tiles // -(-k_tiles // max(1, splits)))


def config_cost_us(in_features: int, slice_sizes: tuple[int, ...], num_slots: int, num_rows: int, splits: int,
                   chunks: int, block_r: int = 16, block_m: int = BLOCK_M, block_k: int = 64,
                   block_n: int = 64) -> float:
    """Modeled time of shrink + expand with `splits` K splits and `chunks` column chunks at `num_rows` padded rows and
    a pool of `num_slots` (tiles BLOCK_K x BLOCK_N, rank tile `block_r`, groups of at most `block_m` rows): shrink's
    programs walk their K range in `block_k` tiles; expand's sum the partials (`splits_per_load` a load), then walk
    their column tiles; every program of both grids (`max_groups` groups x slices x splits or chunks) costs its share
    of the launch. Fitted at BLOCK_M 16: for larger groups it assumes a tile iteration costs the same whatever its
    rows (a latency chain), not measured yet."""
    s = len(slice_sizes)
    k_tiles = -(-in_features // block_k)
    n_tiles = max(-(-n // block_n) for n in slice_sizes)
    splits = effective_splits(k_tiles, splits)
    chunks = max(1, min(chunks, n_tiles))
    shrink = -(-k_tiles // splits) * (SHRINK_ITERATION_US + SHRINK_US_PER_KVALUES * block_k * block_r / 1024)
    expand = -(-n_tiles // chunks) * (EXPAND_ITERATION_US + EXPAND_US_PER_KVALUES * block_n * block_r / 1024)
    partials = (-(-splits // splits_per_load(block_r, block_m)) - 1) * PARTIALS_LOAD_US
    grid = max_groups(num_rows, num_slots, block_m) * s
    return shrink + expand + partials + SHRINK_PROGRAM_US * grid * splits + EXPAND_PROGRAM_US * grid * chunks \
        + LAUNCH_PAIR_US


@functools.lru_cache(maxsize=4096)
def choose_splits(in_features: int, slice_sizes: tuple[int, ...], num_slots: int, num_rows: int,
                  block_r: int = 16, block_m: int = BLOCK_M, block_k: int = 64, block_n: int = 64) -> tuple[int, int]:
    """(K splits of shrink, column chunks of expand) of least `config_cost_us` at these tiles, the fewest on a tie,
    among the configs a launch runs (`effective_splits` of each option: at most one split per K tile; at most one
    chunk per column tile of the widest slice). Decode launches are latency-bound, so splits and chunks shorten the
    programs' chains of tiles until the programs themselves cost more. Cached: an eager step asks once per fused
    linear, with a handful of distinct shapes."""
    k_tiles = -(-in_features // block_k)
    n_tiles = max(-(-n // block_n) for n in slice_sizes)
    best = (float("inf"), 1, 1)
    for splits in sorted({effective_splits(k_tiles, n) for n in SPLIT_OPTIONS}):
        for chunks in CHUNK_OPTIONS:
            if chunks > n_tiles:
                break
            cost = config_cost_us(in_features, slice_sizes, num_slots, num_rows, splits, chunks, block_r, block_m,
                                  block_k, block_n)
            if cost < best[0] * (1 - 1e-9):
                best = (cost, splits, chunks)
    return best[1], best[2]


def tile_options(block_r: int, elem_bytes: int = 2, max_bytes: int | None = None) -> tuple[tuple[int, int], ...]:
    """The (BLOCK_K, BLOCK_N) of TILE_OPTIONS whose A and B tiles hold at most MAX_TILE_VALUES values at `block_r`
    and, when given, at most `max_bytes` bytes (`max_tile_bytes` of the device); the first only for weights of more
    than 2 bytes (not measured wider)."""
    if elem_bytes > 2:
        return TILE_OPTIONS[:1]
    fits = tuple(t for t in TILE_OPTIONS if max(t) * block_r <= MAX_TILE_VALUES
                 and (max_bytes is None or max(t) * block_r * elem_bytes <= max_bytes))
    return fits or TILE_OPTIONS[:1]


# shared memory a block may opt into, by compute capability: torch's device properties name it only from 2.6 on
SHARED_MEMORY_BY_CAPABILITY = {(9, 0): 227 << 10, (8, 0): 163 << 10, (8, 7): 163 << 10, (8, 6): 99 << 10,
                               (8, 9): 99 << 10, (7, 5): 64 << 10, (7, 0): 96 << 10}


def shared_memory_bytes(props: Any) -> int:
    """The shared memory a block may opt into on a device with these properties (torch's, or a stand-in): the
    property where torch has it, else by compute capability (48 KiB where unknown)."""
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    return smem or SHARED_MEMORY_BY_CAPABILITY.get((props.major, props.minor), 48 << 10)


@functools.lru_cache(maxsize=16)
def max_tile_bytes(device: torch.device) -> int | None:
    """The most bytes an A or B tile may take on `device`: its shared memory a block over TILE_SHARED_MEMORY_SHARE;
    None off CUDA (the interpreter runs its own tiles)."""
    if device.type != "cuda":
        return None
    return shared_memory_bytes(torch.cuda.get_device_properties(device)) // TILE_SHARED_MEMORY_SHARE


@functools.lru_cache(maxsize=1024)
def choose_tiles(in_features: int, slice_sizes: tuple[int, ...], num_slots: int, block_r: int = 16,
                 block_m: int = BLOCK_M, elem_bytes: int = 2, max_bytes: int | None = None) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_N) of a stack: the `tile_options` whose best splits and chunks cost least at
    TILE_REFERENCE_ROWS padded rows (the first on a tie). Fixed per stack, never per batch size: one compiled variant
    per fused linear."""
    best = (float("inf"), TILE_OPTIONS[0])
    for bk, bn in tile_options(block_r, elem_bytes, max_bytes):
        splits, chunks = choose_splits(in_features, slice_sizes, num_slots, TILE_REFERENCE_ROWS, block_r, block_m,
                                       bk, bn)
        cost = config_cost_us(in_features, slice_sizes, num_slots, TILE_REFERENCE_ROWS, splits, chunks, block_r,
                              block_m, bk, bn)
        if cost < best[0] * (1 - 1e-9):
            best = (cost, (bk, bn))
    return best[1]


def choose_config(in_features: int, slice_sizes: tuple[int, ...], num_slots: int, num_rows: int,
                  block_r: int = 16, block_m: int = BLOCK_M, elem_bytes: int = 2,
                  max_bytes: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_K, BLOCK_N, K splits, column chunks) of a stack at `num_rows` padded rows: the stack's tiles
    (`choose_tiles`, within `max_bytes` a tile), then the splits and chunks of least modeled time at those tiles and
    rows."""
    bk, bn = choose_tiles(in_features, slice_sizes, num_slots, block_r, block_m, elem_bytes, max_bytes)
    return (bk, bn, *choose_splits(in_features, slice_sizes, num_slots, num_rows, block_r, block_m, bk, bn))


def bgmv_config(stack: LoRAStack, num_rows: int = 64, k_split_cols: int | None = None,
                block_m: int = BLOCK_M) -> BGMVConfig:
    """The decode config of `stack` at `num_rows` padded rows in groups of at most `block_m` rows (the metadata's
    `group_rows`); `k_split_cols` forces K splits of that many columns (tests), otherwise `choose_config` decides.
    The interpreter runs INTERPRETER_TILE-wide tiles with the GPU's splits and chunks."""
    block_r = max(16, _next_pow2(stack.max_rank))
    bk, bn, splits, chunks = choose_config(stack.in_features, stack.slice_sizes, stack.num_slots, num_rows, block_r,
                                           block_m, stack.lora_a.element_size(), max_tile_bytes(stack.lora_a.device))
    if _interpreted(stack.lora_a):
        bk = bn = INTERPRETER_TILE
    return config_with_splits(block_m, block_r, bk, bn, stack.in_features,
                              splits if k_split_cols is None else -(-stack.in_features // k_split_cols),
                              chunks, max(stack.slice_sizes))


def config_with_splits(block_m: int, block_r: int, block_k: int, block_n: int, k: int, splits: int, chunks: int,
                       n_max: int) -> BGMVConfig:
    """The config of these tiles with `splits` K splits of whole BLOCK_K tiles and `chunks` column chunks (at most
    one per BLOCK_N tile of the widest slice, `n_max` columns)."""
    per_split = -(-k // max(1, splits))
    k_per_split = -(-per_split // block_k) * block_k                  # rounded up to a multiple of BLOCK_K
    chunks = max(1, min(chunks, -(-n_max // block_n)))
    return BGMVConfig(block_m, block_r, block_k, block_n, -(-k // k_per_split), k_per_split, chunks)


def scaled_config(stack: LoRAStack, real_in: int, real_sizes: tuple[int, ...], num_rows: int,
                  scale: int, block_m: int = BLOCK_M, real_elem_bytes: int = 2) -> BGMVConfig:
    """The config the kernels choose at the real widths (in `real_in`, slices `real_sizes`, weights of
    `real_elem_bytes`), with every width of the tiling divided by `scale`: run on a stack `scale` times narrower (of
    any dtype), it launches the real grids (benchmarks/lora_kernel_bytes.py, which counts bytes in the interpreter
    at reduced widths)."""
    block_r = max(16, _next_pow2(stack.max_rank))
    bk, bn, splits, chunks = choose_config(real_in, real_sizes, stack.num_slots, num_rows, block_r, block_m,
                                           real_elem_bytes)
    cfg = config_with_splits(block_m, block_r, max(16, bk // scale), max(16, bn // scale), stack.in_features,
                             splits, chunks, max(stack.slice_sizes))
    assert cfg.num_k_splits == splits and cfg.num_n_chunks == chunks, \
        f"{cfg} does not scale to {splits}/{chunks}: tiles of {bk} x {bn} / {scale} columns are under 16"
    return cfg


def triton_bgmv_shrink(x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                       config: BGMVConfig | None = None) -> torch.Tensor:
    """h [num_k_splits, S, B, BLOCK_R] float32: per K split, x[row] @ A_slot(row)^T of every slice, in one
    launch. Only the first `rank` columns of a LoRA row are written (expand reads no more); rows of slot -1
    are not written. h is linear in x: partial results of A split by input columns add up (row-parallel TP)."""
    from adapters.lora_ops import bgmv_kernels as K  # optional: triton

    assert x.stride(1) == 1 and stack.lora_a.stride(3) == 1, "BGMV shrink needs unit x column / A K strides"
    cfg = config or bgmv_config(stack, meta.num_tokens, block_m=meta.group_rows)
    assert cfg.block_m == meta.group_rows, f"BLOCK_M {cfg.block_m} for groups of {meta.group_rows} rows"
    num_rows, num_slices = meta.num_tokens, stack.num_slices
    h = torch.empty((cfg.num_k_splits, num_slices, num_rows, cfg.block_r), dtype=torch.float32,
                    device=x.device)                                         # [splits, S, B, BLOCK_R]
    K.bgmv_shrink_kernel[(max_groups(num_rows, stack.num_slots, cfg.block_m), num_slices, cfg.num_k_splits)](
        x, stack.lora_a, h, meta.row_order, meta.groups, stack.ranks,
        stack.in_features, cfg.k_per_split, meta.groups.stride(0),
        x.stride(0),
        stack.lora_a.stride(0), stack.lora_a.stride(1), stack.lora_a.stride(2),
        h.stride(0), h.stride(1), h.stride(2),
        stack.ranks.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, DOT_FP32=_dot_fp32(x), **cfg.launch_options())
    return h


def _dot_fp32(t: torch.Tensor) -> bool:
    return _interpreted(t) or t.dtype == torch.float32


def triton_bgmv_expand(y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                       y_offset: int = 0, config: BGMVConfig | None = None, accumulate: bool = True,
                       dora: bool = True) -> None:
    """y[row, y_offset + slice columns] += scale * (sum over K splits of h[:, s, row]) @ B_slot(row)^T, then a
    DoRA slot's rescaling of those columns (in the kernel's epilogue). `accumulate=False` writes the delta instead
    of adding it (y is a delta buffer), `dora=False` leaves the rescaling out (bgmv_overlap.py does both later)."""
    from adapters.lora_ops import bgmv_kernels as K  # optional: triton

    assert y.stride(1) == 1 and stack.lora_b.stride(2) == 1, "BGMV expand needs unit y column / B rank strides"
    cfg = config or bgmv_config(stack, meta.num_tokens, block_m=meta.group_rows)
    assert cfg.block_m == meta.group_rows, f"BLOCK_M {cfg.block_m} for groups of {meta.group_rows} rows"
    num_rows, num_slices = meta.num_tokens, stack.num_slices
    assert h.dim() == 4 and tuple(h.shape[1:]) == (num_slices, num_rows, cfg.block_r) and \
        h.dtype == torch.float32 and h.stride(3) == 1, f"h {tuple(h.shape)} is not this stack's shrink output"
    dora = dora and stack.dora_scale is not None
    d_scale, d_shift, d_flags = (stack.dora_scale, stack.dora_shift, stack.dora_flags) if dora else \
        (stack.scalings, stack.scalings, stack.ranks)             # never read (HAS_DORA off)
    K.bgmv_expand_kernel[(max_groups(num_rows, stack.num_slots, cfg.block_m), cfg.num_n_chunks, num_slices)](
        h, stack.lora_b, y, meta.row_order, meta.groups, stack.ranks, stack.scalings, stack.slice_meta,
        d_scale, d_shift, d_flags,
        num_slices, h.shape[0], y_offset, meta.groups.stride(0),
        h.stride(0), h.stride(1), h.stride(2),
        stack.lora_b.stride(0), stack.lora_b.stride(1),
        y.stride(0),
        stack.ranks.stride(0), stack.scalings.stride(0), d_scale.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, DOT_FP32=_dot_fp32(stack.lora_b),
        HAS_DORA=dora, SPLITS_PER_LOAD=splits_per_load(cfg.block_r, cfg.block_m), ACCUMULATE=accumulate,
        **cfg.launch_options())


def triton_bgmv_add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                         y_offset: int = 0, config: BGMVConfig | None = None) -> None:
    """y[row] += LoRA_slot(row)(x[row]) for every row: one shrink and one expand launch for all slices."""
    cfg = config or bgmv_config(stack, meta.num_tokens, block_m=meta.group_rows)
    h = triton_bgmv_shrink(x, stack, meta, cfg)                              # [splits, S, B, BLOCK_R]
    triton_bgmv_expand(y, h, stack, meta, y_offset, cfg)


def torch_bgmv_add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                        y_offset: int = 0) -> None:
    """The torch reference of the same op (reads the slots back to the host: tests and CPU only)."""
    slots = meta.row_slots.to("cpu", torch.int64)                            # [B]
    rows = torch.nonzero(slots >= 0).squeeze(1)                              # [n]
    if rows.numel():
        torch_add_lora_rows(y, x, stack, rows.to(x.device), slots[rows].to(x.device), y_offset)
