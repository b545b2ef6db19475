"""Parsers of model output for the protocol handlers: tool calls (:mod:`.tool_calls`)."""
