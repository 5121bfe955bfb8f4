"""Engine buffers the sidecar copies pages out of and into (shm; cuda_ipc on GPU nodes)."""
