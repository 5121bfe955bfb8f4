"""The engine adapters' own parts (api/engine/), without an engine: the core suite runs them
beside the engine suites, which need the engines' virtualenvs."""
