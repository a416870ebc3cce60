"""Two tenants on one base model, then a third hot-loaded through the admin API.

Start the server first (see examples/README.md):

    .venv/bin/loraplex serve --dtype float32 \\
        --lora-modules tenant-email=examples/adapters/tenant-email tenant-asyncio=examples/adapters/tenant-asyncio \\
        --admin-token admin-secret

then:

    .venv/bin/python examples/two_tenants.py --admin-token admin-secret

The completions go through the stock `openai` client (the tenant is the `model` field); loading and
unloading an adapter are plain HTTP calls (httpx) with the admin token.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import httpx
from openai import OpenAI

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="where `loraplex serve` listens")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"),
                   help="only checked when the server runs with --api-key / --tenant-keys")
    p.add_argument("--admin-token", default=os.environ.get("LORAPLEX_ADMIN_TOKEN"),
                   help="the server's --admin-token (default: $LORAPLEX_ADMIN_TOKEN); without it, no hot-load")
    p.add_argument("--tenants", nargs=2, default=["tenant-email", "tenant-asyncio"], metavar="NAME")
    p.add_argument("--hot-load", default="tenant-tests", metavar="NAME", help="adapter to load at run time")
    p.add_argument("--hot-load-path", default=str(HERE / "adapters" / "tenant-tests"))
    p.add_argument("--prompt", default="    def __init__(self")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--keep", action="store_true", help="leave the hot-loaded adapter loaded")
    args = p.parse_args()

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    models = client.models.list().data
    base = next(m.id for m in models if m.parent is None)
    print("served models:")
    for m in models:
        print(f"  {m.id:<16} parent={m.parent} root={m.root}")

    def show(model: str) -> None:
        out = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens,
                                        temperature=0)
        print(f"\n--- {model} ({out.usage.completion_tokens} tokens, finish_reason={out.choices[0].finish_reason})")
        print(args.prompt + out.choices[0].text)

    print(f"\nsame prompt {args.prompt!r}, greedy, one model per tenant:")
    for model in (base, *args.tenants):
        show(model)

    if not args.admin_token:
        print("\n(no --admin-token: skipping the hot-load of a third tenant)")
        return
    admin = httpx.Client(base_url=args.base_url, headers={"Authorization": f"Bearer {args.admin_token}"},
                         timeout=120)
    resp = admin.post("/v1/load_lora_adapter", json={"lora_name": args.hot_load, "lora_path": args.hot_load_path})
    print(f"\nPOST /v1/load_lora_adapter {args.hot_load} -> {resp.status_code} {resp.text}")
    resp.raise_for_status()
    show(args.hot_load)
    if not args.keep:
        resp = admin.post("/v1/unload_lora_adapter", json={"lora_name": args.hot_load})
        print(f"\nPOST /v1/unload_lora_adapter {args.hot_load} -> {resp.status_code} {resp.text}")
        resp.raise_for_status()
    print("\nnow serving:", [m.id for m in client.models.list().data])


if __name__ == "__main__":
    main()
