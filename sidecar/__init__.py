"""kv-sidecar: the process. Config, CLI, the store (namespaces -> pools -> tiers), transports."""

__version__ = "0.1.0"
