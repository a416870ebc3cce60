"""Tenants (`--tenant-keys`) and the admission limits per tenant and server-wide."""
