"""Observability of the prefix cache: why requests miss (``radixkv explain``) and how much KV
memory a model and its traffic need (``radixkv plan``).

Modules: :mod:`~radixkv.obs.trace` (JSONL request traces, tokenization, the writer the server
and ``replay`` use), :mod:`~radixkv.obs.explain` (the report), :mod:`~radixkv.obs.spans`
(volatile-span finder and rewrites), :mod:`~radixkv.obs.synthetic` (agent traces from ShareGPT
questions), :mod:`~radixkv.obs.plan` and :mod:`~radixkv.obs.architectures` (the capacity
planner and its table of config facts), :mod:`~radixkv.obs.report` (terminal, JSON, HTML),
:mod:`~radixkv.obs.cli`. Fed by the cache simulator (:mod:`radixkv.sim`) and the engine's
per-request cache outcomes (:mod:`radixkv.cache.outcome`). See docs/explain.md.
"""
