"""Micro-benches: the hot routes against their limits, the socket, tiers, recovery, stalls,
events and the CUDA copy, each a ratio against a limit measured in the same run."""
