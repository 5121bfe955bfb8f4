"""`make bench-serve`: `vllm serve` fleets behind the sidecar, LMCache or nothing, driven by
Locust users playing conversations or the public trace."""
