"""`python -m gateway serve ...` is the same as the `loraplex` console script."""
from __future__ import annotations

import sys

from gateway.cli import main

sys.exit(main())
