"""Engine-level benches: one vLLM or SGLang engine with and without the sidecar."""
