"""The executor: runs forward passes of a model over the paged KV pool.

:class:`~radixkv.executor.model_runner.ModelRunner` owns the model, the KV pool, the block table
and the attention backend; it builds each step's :class:`~radixkv.attention.metadata.ForwardBatch`
and picks the path of the forward: the fused native CPU decode step
(:mod:`radixkv.executor.cpu_decode`) when it is eligible, else the model's module path.
"""
