"""The float64 definition of paged decode attention that the CPU decode paths are checked against
(tests/test_core/attention/test_torch_decode.py, test_cpu_paged_decode.py)."""
from __future__ import annotations

import torch


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """float64, one sequence and one head at a time, straight from the definition. q [B, H, D], caches
    [num_blocks, block_size, Hkv, D], tables [B, nb], lens [B] (keys, the new one included). Returns [B, H, D]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    groups = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        k = k_cache[tables[i]].reshape(-1, k_cache.shape[2], k_cache.shape[3])[:n].double()   # [L, Hkv, D]
        v = v_cache[tables[i]].reshape(-1, v_cache.shape[2], v_cache.shape[3])[:n].double()   # [L, Hkv, D]
        first = 0 if window is None else max(0, n - window)
        for h in range(q.shape[1]):
            s = k[first:, h // groups] @ q[i, h].double() * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ v[first:, h // groups]
    return out
