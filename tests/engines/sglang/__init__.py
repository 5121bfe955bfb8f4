"""SGLang's adapter suites (`make test-sglang`). The kit's package defines torchvision's op
schemas before any test module imports SGLang (loadtest/kit/sglang/__init__.py says why)."""

import loadtest.kit.sglang  # noqa: F401
