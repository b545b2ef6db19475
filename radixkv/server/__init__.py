"""The OpenAI-compatible HTTP server: ``create_app(async_llm)`` (FastAPI) and `radixkv serve`.

Modules: :mod:`~radixkv.server.app` (routes, error format), :mod:`~radixkv.server.engine_client`
(prompts -> engine requests -> outputs, typed errors; shared by every protocol),
:mod:`~radixkv.server.openai` (the OpenAI protocol: bodies, parameter mapping, one handler per
endpoint), :mod:`~radixkv.server.sse` (event-stream helpers), :mod:`~radixkv.server.metrics`
(Prometheus), :mod:`~radixkv.server.cli` (`radixkv serve`).
See docs/server.md.
"""

from __future__ import annotations

__all__ = ["create_app"]


def __getattr__(name: str):
    # Lazy, so `radixkv --help` does not import FastAPI.
    if name == "create_app":
        from radixkv.server.app import create_app

        return create_app
    raise AttributeError(f"module 'radixkv.server' has no attribute {name!r}")
