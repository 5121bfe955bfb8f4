"""The tools' floor: what tests and benches share to run the real parts.

procs        free ports, engine sockets, the one sidecar launcher (variants by subclass)
unix_http    http.client over an engine socket
calls        small helpers: a call's HTTP status, a page's bytes
as_uid       the sidecar and engine calls as another uid (forked, setuid)
mooncake     a real Mooncake master and metadata server
vllm/        the vLLM CPU engine process and its tiny models
sglang/      SGLang's own pools, controllers and linker tree on CPU
"""
