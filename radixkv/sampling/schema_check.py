"""JSON-schema keywords the grammar would not enforce.

xgrammar (0.2.9) turns a JSON schema into a grammar and drops some keywords without a word: a
schema with ``"uniqueItems": true`` compiles, and the output may repeat items. A constraint the
output does not obey is a field silently ignored, so :func:`unenforced_keyword` finds them and
:mod:`radixkv.sampling.grammar` refuses such a schema (``RequestError`` naming the field that
carried it, the keyword and where it is), as vLLM refuses a schema with features its xgrammar
backend does not support. ``tests/test_grammar.py`` checks each against xgrammar: dropped, it
is listed here; enforced by a later xgrammar, its test fails and it can leave the list.

Not enforced (anywhere in the schema, ``$defs`` and tools' ``parameters`` included):

* ``uniqueItems: true``, ``contains`` / ``minContains`` / ``maxContains``;
* ``not``, ``if`` / ``then`` / ``else``, ``dependentRequired``, ``dependentSchemas``,
  ``dependencies``;
* ``multipleOf`` unless the schema's ``type`` is ``"integer"`` (or a list with ``"integer"`` and
  no ``"number"``): xgrammar enforces it on integers only;
* ``allOf`` unless it has one subschema and its schema nothing but annotations (and ``$defs``)
  beside it (the ``{"allOf": [{"$ref": ...}], "description": ...}`` form pydantic writes):
  xgrammar merges nothing.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

__all__ = ["unenforced_keyword", "structural_tag_schemas"]

_ANNOTATIONS = frozenset(
    ("title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$id")
    + ("$schema", "$defs", "definitions")
)
_ALWAYS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains")
_ALWAYS += ("minContains", "maxContains")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("additionalProperties", "items", "additionalItems", "propertyNames", "unevaluatedProperties")
_ONE += ("unevaluatedItems", "contains", "not", "if", "then", "else")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _why(node: dict) -> Optional[tuple[str, str]]:
    """(keyword, why) of the first keyword of ``node`` itself the grammar would drop."""
    if node.get("uniqueItems") is True:
        return "uniqueItems", "the grammar cannot keep the items distinct"
    for key in _ALWAYS:
        if key in node:
            return key, "the grammar does not support it"
    if "multipleOf" in node:
        types = node.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if "integer" not in types or "number" in types:
            return "multipleOf", 'the grammar enforces it only with "type": "integer"'
    if "allOf" in node:
        others = set(node) - {"allOf"} - _ANNOTATIONS
        if not isinstance(node["allOf"], list) or len(node["allOf"]) != 1 or others:
            return "allOf", "the grammar merges no subschemas; one alone, beside annotations only, is supported"
    return None


def _children(node: dict, path: str) -> Iterator[tuple[Any, str]]:
    for key in _MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                yield child, f"{path}/{key}/{name}"
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield node[key], f"{path}/{key}"
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield child, f"{path}/{key}/{i}"


def unenforced_keyword(schema: Any, path: str = "#") -> Optional[str]:
    """A message naming the first keyword of the JSON ``schema`` (a dict; booleans and other
    values have none) that the grammar would not enforce, with its JSON-pointer path, or None."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _why(node)
        if found is not None:
            key, why = found
            return f"{where}/{key}: {key} is not enforced ({why}); the output would not be held to it"
        stack.extend(reversed(list(_children(node, where))))
    return None


def structural_tag_schemas(tag: Any, path: str = "structural_tag") -> Iterator[tuple[Any, str]]:
    """Every JSON schema of an xgrammar structural tag (its ``{"type": "json_schema",
    "json_schema": ...}`` contents, e.g. the tools' ``parameters``), with where it is."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            yield tag["json_schema"], path
            return
        for key, value in tag.items():
            yield from structural_tag_schemas(value, f"{path}.{key}")
    elif isinstance(tag, list):
        for i, value in enumerate(tag):
            yield from structural_tag_schemas(value, f"{path}[{i}]")
