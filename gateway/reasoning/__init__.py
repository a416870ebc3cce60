"""`--reasoning-parser`: the `<think>` part of a chat output and the responses that carry it."""
