"""Native kernels behind checked Python entry points.

:mod:`radixkv.kernels.cpu`: radixkv's own float32 CPU kernels (``csrc/cpu_kernels/``, built as
the optional extension ``radixkv.kernels._ckernels``): packed-weight GEMM, paged attention,
RMSNorm, RoPE, SwiGLU and a whole decoder layer. GPU kernels come from FlashInfer
(:mod:`radixkv.attention.flashinfer_backend`).
"""
