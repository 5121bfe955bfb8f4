"""A vLLM CPU engine in its own process with the sidecar's connector, and tiny random
models to run it on (`.venv-vllm`)."""
