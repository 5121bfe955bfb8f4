"""The compiled parts: KV events' packer (sidecar/_evpack.c) and the copy of a plan's runs
(sidecar/_kvcopy.c). Optional: without a C compiler the install goes on, sidecar/events.py
packs the same bytes in Python and sidecar/transports/shm.py copies with ctypes.memmove."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar._evpack", ["sidecar/_evpack.c"], optional=True, extra_compile_args=["-O2"]
        ),
        Extension(
            "sidecar._kvcopy", ["sidecar/_kvcopy.c"], optional=True, extra_compile_args=["-O2"]
        ),
    ]
)
