"""Run-time matching: compiled grammars, per-request matchers, triggered matchers, token bitmasks."""
