"""Prometheus metrics, the `--metrics-port` listener and the request log."""
