"""Both sides of kv-sidecar's HTTP contract: what the sidecar serves, and the clients that
speak it (most of the lines are the clients: the engine adapters).

    api/*.py      the server side: app, routes, error table, guard, wire helpers (imports
                  sidecar/, the process they serve)
    api/engine/   what an engine imports: client, shm helpers, CUDA export, SGLang backend
                  and linker, vLLM connector (never imports the server side, nor torch-free
                  code of the sidecar: an engine process loads it alone)
    api/cli/      the `sidecar` command: `serve` (sidecar/cli.py) and the operator's
                  clients (replay, plan, pin|unpin|evict|warm|pins)
    api/sglang_backend.py, api/vllm_connector.py
                  stable import paths that engine configs name
"""
