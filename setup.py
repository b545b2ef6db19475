"""Builds radixkv's optional C extensions.

* csrc/prefix_match.c -> radixkv.cache._cprefix: the radix tree's walks (docs/cache.md).
* csrc/cpu_kernels/*.c -> radixkv.kernels._ckernels: float32 GEMM and paged attention for CPU decode
  (AVX2/FMA, checked at run time; docs/model.md), one file per concern (csrc/cpu_kernels/internal.h
  lists them). Built with OpenMP when the compiler has it, so its threads are torch's own libgomp
  workers; without OpenMP it falls back to its pthread pool (same results).

All metadata lives in pyproject.toml. Both extensions are ``optional``: if no C compiler is
there, the build goes on without them and radixkv uses its pure-Python / torch paths (same
results, slower). ``pip install -e .`` builds them in place.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = ["-fopenmp"]
KERNELS = "csrc/cpu_kernels"
KERNEL_SOURCES = [
    f"{KERNELS}/{name}.c"
    for name in (
        "bindings",
        "threadpool",
        "gemm",
        "gemm_small",
        "quant",
        "kvformat",
        "attention",
        "attention_lowp",
        "ops",
        "step",
    )
]


class BuildExt(build_ext):
    """build_ext that builds radixkv.kernels._ckernels with ``-fopenmp`` first and, when the compiler or
    linker refuses it, again without (the kernels then use their own pthread pool)."""

    def build_extension(self, ext):
        if OPENMP[0] not in ext.extra_compile_args:
            return super().build_extension(ext)
        try:
            return super().build_extension(ext)
        except Exception as e:  # CompileError / LinkError: retry without OpenMP
            print(f"building {ext.name} with OpenMP failed ({e}); building it with its pthread pool")
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
            ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
            return super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "radixkv.cache._cprefix",
            sources=["csrc/prefix_match.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "radixkv.kernels._ckernels",
            sources=KERNEL_SOURCES,
            depends=[f"{KERNELS}/internal.h"],
            extra_compile_args=["-O3", "-pthread", *OPENMP],
            extra_link_args=["-pthread", *OPENMP],
            optional=True,
        ),
    ],
)
