"""The sampling path: turning a step's logits into tokens.

:mod:`radixkv.sampling.sampler`: greedy / temperature / top-p / top-k / min-p sampling with
per-request generators. Logits processors (penalties, biases, grammar masks) belong here too.
"""
