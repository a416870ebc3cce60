"""A tiny test model whose greedy output begins with a chosen text (random tiny models write noise).

Every layer's output projection is zeroed, so the last hidden state is the current token's embedding and the
next token depends on the current one alone. The text is given as pieces, each one token (added to the
tokenizer as an ordinary, non-special token when the vocabulary lacks it) and all different, chained: each
piece's embedding is its own axis, and the `lm_head` row of the next piece points along it. Every other token
shares one more axis, which points to the first piece: whatever the prompt, greedy decoding writes the pieces,
then (a grammar may constrain the rest) whatever the random rest of `lm_head` prefers. Built beside the
tests, never in core/.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tiny_models import TinyModelSpec, tiny_model_dir


def scripted_model(root: Path, pieces: list[str], chat_template: str | None = None,
                   strength: float = 50.0, special: tuple[str, ...] = ()) -> Path:
    """A tiny Llama under `root` whose greedy output begins with "".join(pieces). `special`: tokens added as
    special tokens first (Mistral's `[TOOL_CALLS]`: skip_special_tokens drops their text, and they have no
    grammar bytes); a piece may be one of them."""
    from transformers import AddedToken, AutoTokenizer

    assert len(set(pieces)) == len(pieces), "the pieces must be different tokens"
    model_dir = tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=1024, vocab_size=576),
                               root=root)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if special:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tokenizer.add_tokens([p for p in pieces if len(tokenizer.encode(p, add_special_tokens=False)) != 1])
    tokenizer.save_pretrained(str(model_dir))
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(i) == 1 for i in ids), ids
    ids = [i[0] for i in ids]
    if chat_template is not None:
        (model_dir / "chat_template.jinja").unlink(missing_ok=True)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = chat_template
        config_file.write_text(json.dumps(config))

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert max(ids) < embed.shape[0] and len(ids) < embed.shape[1]
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    weights["model.norm.weight"].fill_(1.0)
    others = len(ids)                       # the axis every token outside the chain shares
    embed.zero_()
    embed[:, others] = 1.0
    for k, token_id in enumerate(ids):
        embed[token_id].zero_()
        embed[token_id, k] = 1.0
    # the rest of lm_head stays random (no ties where a grammar masks the scripted token)
    head[ids[0], others] += strength
    for k in range(len(ids) - 1):
        head[ids[k + 1], k] += strength
    save_file(weights, str(path), metadata={"format": "pt"})
    return model_dir
