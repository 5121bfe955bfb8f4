"""`python -m sidecar`: the same CLI as the `sidecar` command (`api.cli.main`: serve, replay,
plan and the operator controls). Named by string: like sidecar/server.py's app, this is the
process's composition root, the one place the sidecar floor names the api floor above it
(tests/test_layering.py, COMPOSITION_ROOT)."""

import importlib
import sys

sys.exit(importlib.import_module("api.cli").main())
