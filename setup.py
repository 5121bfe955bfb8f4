"""The one compiled part: KV events' packer (sidecar/_evpack.c). Optional: without a C
compiler the install goes on and sidecar/events.py packs the same bytes in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar._evpack", ["sidecar/_evpack.c"], optional=True, extra_compile_args=["-O2"]
        )
    ]
)
