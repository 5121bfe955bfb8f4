"""Benchmarks, load tests and trace replay for kv-sidecar (loopback only)."""
