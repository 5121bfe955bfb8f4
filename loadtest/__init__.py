"""The tools: benchmarks, load tests, the red team and the chaos soak (a checkout's, never
shipped in the wheel or the image). Tests import them; they import no test.

    kit/       the floor every tool and test stands on: the one sidecar launcher, engine
               sockets, the as-uid runner, the vLLM and SGLang engine kits, a Mooncake cluster
    serving/   `make bench-serve`: `vllm serve` fleets under Locust
    engines/   one engine with and without the sidecar (`make bench-engines`, `bench-vllm`)
    redteam/   attacks of a hostile local user (`python -m loadtest.redteam.runner`)
    chaos/     the soak with faults and a ledger (`make soak`)
    micro/     the hot routes, socket, tiers, recovery, events and CUDA against their limits
"""
