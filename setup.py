"""Builds radixkv's optional C helper (csrc/prefix_match.c -> radixkv.cache._cprefix).

All metadata lives in pyproject.toml. The extension is ``optional``: if no C compiler is there,
the build goes on without it and radixkv uses the pure-Python path (same results, slower; see
docs/cache.md). ``pip install -e .`` builds it in place.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "radixkv.cache._cprefix",
            sources=["csrc/prefix_match.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
