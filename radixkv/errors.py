"""`RequestError`: an invalid request, as a ``ValueError`` that names the field at fault;
`RequestFailed`: a valid request that failed inside the engine (its row's sampling raised).

The engine, ``SamplingParams`` and the chat renderer raise it; the server turns it into an HTTP
400 in OpenAI's error format with ``param`` set from :attr:`RequestError.param` (no parsing of
the message).
"""

from __future__ import annotations

__all__ = ["QueueFullError", "RequestError", "RequestFailed"]


class RequestError(ValueError):
    """A request the engine refuses.

    Args:
        message: what is wrong, naming the field and the limit.
        param: the field at fault (``SamplingParams`` / ``add_request`` names: ``"max_tokens"``,
            ``"prompt"``, ``"messages"``, ...), or None when no single field is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """One request failed inside the engine: its sampling, logits processing, grammar or output
    processing raised for its row (finish_reason ``"error"``). Only that request stopped; the
    engine and the other requests go on. :class:`~radixkv.async_llm.AsyncLLM` raises it from the
    request's stream; the server answers it with a 500 ``server_error`` (code
    ``request_failed``) in OpenAI's error format, or that error in-band on a stream.

    Args:
        output: the request's final :class:`~radixkv.outputs.RequestOutput` (``error`` set).
    """

    def __init__(self, output) -> None:
        super().__init__(f"request {output.request_id} failed in the engine: {output.error}")
        self.output = output
        self.request_id = output.request_id

    def __reduce__(self):
        # NOTE: pickle's default rebuilds an exception from ``self.args`` (the message), which
        # this constructor cannot take; across Ray replicas the ingress then got Ray's
        # UnserializableException (500 internal_error naming the replica's pid and IP)
        return (type(self), (self.output,))


class QueueFullError(RequestError):
    """The engine's waiting queue is full (``EngineConfig.max_queued_requests``, or the request's
    tenant's share, ``max_queued_requests_per_tenant``, the ``param``): the request is
    valid but refused for now; retry later. The server answers it with HTTP 429 (code
    ``queue_full``): the server is healthy but saturated, so the client should back off and retry
    (OpenAI's clients retry 429s), while 503 keeps meaning that the engine has stopped."""

    def __init__(self, message: str, param: str = "max_queued_requests") -> None:
        super().__init__(message, param)
