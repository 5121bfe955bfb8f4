"""The HTTP contract of kv-sidecar: routes, wire helpers, the Python client, engine adapters."""
