"""One compiled variant per kernel while serving: metadata segments are 16-byte aligned, tiles fixed.

Triton compiles a new variant of a kernel when a pointer argument's 16-byte alignment changes (or a
constexpr does). Per-step metadata is packed into one buffer per step for a single host->device copy;
if its segments started at offsets that depend on the batch, steps would stall on compiles mid-serving
(the cause of the p99 inter-token latency spikes of the first GPU serving sweep). These tests drive
random batches through the packers (onto `kernel_device()`: pinned, non-blocking copies on a GPU) and check
every segment a kernel reads starts on a 16-byte boundary.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from adapters.lora_ops.metadata import LoRABatchMeta
from core.attention.triton_backend import TritonAttentionBackend
from core.environment.backends import interpreting
from core.execution.packing import aligned_offsets, pack_aligned
from core.execution.runner import HostBatch, to_device
from kernel_device import kernel_device

DEVICE = kernel_device()


def byte_offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def assert_aligned(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert byte_offset(t) % 16 == 0, f"{name} starts at byte {byte_offset(t)} of its buffer"


def test_pack_aligned() -> None:
    assert aligned_offsets([3, 0, 5, 4], 4) == [0, 4, 4, 12, 16]
    assert aligned_offsets([1, 2, 3], 8) == [0, 2, 4, 8]
    arrays = [np.arange(3), np.arange(5) + 10, np.zeros(0, np.int64), np.arange(1) + 7]
    packed, offs = pack_aligned(arrays, np.int32)
    assert packed.dtype == np.int32 and offs == [0, 4, 12, 12, 16]
    for a, start in zip(arrays, offs):
        assert (packed[start:start + len(a)] == a).all()


def random_host_batch(rng: random.Random, block_size: int = 16) -> HostBatch:
    num_decode, num_prefill = rng.randint(0, 9), rng.randint(0, 3)
    if num_decode + num_prefill == 0:
        num_decode = 1
    num_new = np.array([1] * num_decode + [rng.randint(2, 40) for _ in range(num_prefill)], dtype=np.int64)
    starts = np.array([rng.randint(1, 200) for _ in range(len(num_new))], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(num_new)])
    t = int(cu[-1])
    ctx = starts + num_new
    width = int(-(-ctx.max() // block_size))
    tables = np.array([[rng.randrange(0, 1000) for _ in range(width)] for _ in num_new], dtype=np.int64)
    seq_of = np.repeat(np.arange(len(num_new)), num_new)
    positions = np.arange(t) - cu[:-1][seq_of] + starts[seq_of]
    slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
    samples = sorted(rng.sample(range(len(num_new)), rng.randint(1, len(num_new))))
    return HostBatch(requests=[None] * len(num_new), num_new=num_new, cu=cu,
                     token_ids=np.array([rng.randrange(0, 500) for _ in range(t)], dtype=np.int64),
                     positions=positions, slot_mapping=slots, tables=tables, context_lens=ctx,
                     num_decode=num_decode, samples=samples)


@pytest.mark.parametrize("seed", range(25))
def test_step_inputs_and_attention_metadata_are_aligned(seed: int) -> None:
    rng = random.Random(seed)
    host = random_host_batch(rng)
    batch = to_device(host, 16, DEVICE)
    n_dec = host.num_decode
    assert_aligned(input_ids=batch.input_ids, positions=batch.positions, slot_mapping=batch.meta.slot_mapping,
                   logits_indices=batch.logits_indices, decode_context_lens=batch.meta.decode_context_lens)
    assert batch.input_ids.tolist() == host.token_ids.tolist()
    assert batch.positions.tolist() == host.positions.tolist()
    assert batch.meta.decode_context_lens.tolist() == host.context_lens[:n_dec].tolist()
    assert batch.logits_indices.tolist() == (host.cu[1:][host.samples] - 1).tolist()

    backend = TritonAttentionBackend(target_programs=10 ** 6, min_partition=32, max_splits=8)
    km = backend.kernel_meta(batch.meta, num_kv_heads=2, g_p2=4, device=DEVICE)
    assert_aligned(q_starts=km.q_starts, q_lens=km.q_lens, num_splits=km.num_splits, work=km.work)
    q_lens = [1] * n_dec + host.num_new[n_dec:].tolist()
    assert km.q_lens.tolist() == q_lens and km.seq_lens.tolist() == host.context_lens.tolist()
    # two tile shapes only: one query per program for decode-only steps, a full tile otherwise
    full = backend.config(True, interpreting())["block_m"] // 4      # the prefill tile of the device it runs on
    assert km.block_q == (1 if max(q_lens) == 1 else full)
    assert km.work.shape[1] == km.num_items and int(km.work[0].max()) < len(q_lens)


@pytest.mark.parametrize("seed", range(25))
def test_lora_metadata_is_aligned(seed: int) -> None:
    rng = random.Random(seed)
    slots = [rng.choice([-1, 0, 1, 2, 5]) for _ in range(rng.randint(1, 40))]
    meta = LoRABatchMeta.build(slots, DEVICE, num_slots=8)
    assert_aligned(token_ids=meta.token_ids, group_slots=meta.group_slots, group_starts=meta.group_starts,
                   group_sizes=meta.group_sizes)
    lora_pos = [i for i, s in enumerate(slots) if s >= 0]
    assert sorted(meta.token_ids.tolist()) == lora_pos
    assert meta.group_slots.tolist() == sorted({s for s in slots if s >= 0})
    assert sum(meta.group_sizes.tolist()) == len(lora_pos)
    for slot, start, size in zip(meta.group_slots.tolist(), meta.group_starts.tolist(), meta.group_sizes.tolist()):
        assert all(slots[t] == slot for t in meta.token_ids[start:start + size].tolist())

