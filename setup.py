"""Builds radixkv's optional C extensions.

* csrc/prefix_match.c -> radixkv.cache._cprefix: the radix tree's walks (docs/cache.md).
* csrc/cpu_kernels.c -> radixkv._ckernels: float32 GEMM and paged attention for CPU decode
  (AVX2/FMA, checked at run time; docs/model.md).

All metadata lives in pyproject.toml. Both extensions are ``optional``: if no C compiler is
there, the build goes on without them and radixkv uses its pure-Python / torch paths (same
results, slower). ``pip install -e .`` builds them in place.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "radixkv.cache._cprefix",
            sources=["csrc/prefix_match.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "radixkv._ckernels",
            sources=["csrc/cpu_kernels.c"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
