"""`python -m gateway serve ...` is the same as the `loraplex` console script."""
from __future__ import annotations

from gateway.cli import console_main

console_main()
