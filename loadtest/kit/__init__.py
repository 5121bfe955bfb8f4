"""The tools' floor: what tests and benches share to run the real parts.

procs             free ports, engine sockets, the one sidecar launcher (variants by
                  subclass)
unix_http         http.client over an engine socket
calls             the HTTP status a client call met
as_uid            a function or the sidecar as another uid (forked, setuid)
mooncake_cluster  a real Mooncake master and metadata server
vllm/             the vLLM CPU engine process and its tiny models
sglang/           SGLang's own pools, controllers and linker tree on CPU
"""
