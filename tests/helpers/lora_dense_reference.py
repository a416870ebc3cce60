"""A per-token dense reference of batched multi-LoRA (shrink + expand), for the LoRA op tests.

    ref = naive(y, x, a_list, b_list, ranks, scalings, token_slots, y_offset)   # y + LoRA(x), float64
"""


def naive(y, x, a_list, b_list, ranks, scal, token_slots, y_offset=0):
    """Per-token dense reference: y[t, cols_s] += scale * B_s[slot, :, :r] @ A_s[slot, :r] @ x[t]."""
    y = y.clone().double()
    off = y_offset
    for s, (a, b) in enumerate(zip(a_list, b_list)):
        for t, slot in enumerate(token_slots):
            if slot < 0 or ranks[s][slot] == 0:
                continue
            r = ranks[s][slot]
            d = b[slot, :, :r].double() @ (a[slot, :r].double() @ x[t].double())
            y[t, off:off + b.shape[1]] += scal[s][slot] * d
        off += b.shape[1]
    return y
