"""SGLang's native API on radixkv: the ``/generate`` body (:mod:`.protocol`), its handler
(:mod:`.generate`) and the routes (:mod:`.routes`: ``/generate``, ``/get_model_info``,
``/server_info``, ``/health_generate``), so SGLang's frontend language (``sgl.RuntimeEndpoint``)
and ``bench_serving --backend sglang`` run against ``radixkv serve``. See docs/server.md."""
