"""The HTTP contract of kv-sidecar.

    api/*.py      what the sidecar serves: app, routes, error table, guard, wire helpers
    api/engine/   what an engine imports: client, shm helpers, CUDA export, SGLang backend,
                  vLLM connector (never imports the server side)
    api/sglang_backend.py, api/vllm_connector.py
                  stable import paths that engine configs name
"""
