"""What an engine process imports: the client, shared-memory and CUDA export helpers, and the
engine adapters (SGLang HiCache backend, vLLM connector). Nothing here imports the server side
(`api.app`, routes, `sidecar`, `pools`), so an engine needs none of the sidecar's dependencies."""
