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
  xgrammar merges nothing;
* ``multipleOf`` beside ``minimum`` / ``maximum`` / ``exclusive*`` (pydantic's
  ``conint(multiple_of=2, ge=0)``): xgrammar drops the ``multipleOf``;
* ``minLength`` / ``maxLength`` beside ``pattern`` (pydantic's ``constr(pattern=..., min_length=...)``)
  or ``format``, and ``pattern`` beside ``format``: xgrammar drops them;
* a ``pattern`` with a lookahead / lookbehind (``(?=``, ``(?!``): xgrammar drops the assertion
  (the ``regex`` field's too, refused in :mod:`radixkv.sampling.grammar`);
* a ``pattern`` (or ``patternProperties`` key) naming a ``"``, a backslash or a control
  character (``^a"b$``, ``^C:\\\\``, ``\\n``, ``[\\x00-\\x1f]``): xgrammar writes it unescaped, so the
  output is not JSON (ranges of printable characters and negated classes are safe);
* any keyword but annotations beside ``$ref``, ``anyOf`` or ``oneOf`` (``discriminator`` is an
  annotation), and beside ``enum`` / ``const`` anything but ``type`` (whose values must all be of
  that type): xgrammar keeps only the reference / the branches / the values;
* a value keyword (``minimum``, ``minLength``, ``pattern``, ``format``, ``minItems``,
  ``maxProperties``, ...) in a schema without ``type`` (``propertyNames`` excepted);
* ``required`` naming a property not in ``properties``: xgrammar requires only listed ones;
  an ``enum`` / ``const`` holding an integer beyond 64 bits: xgrammar writes it as a float;
  ``propertyNames`` that a property in ``properties`` may break, and a ``patternProperties``
  pattern matching a property in ``properties``: xgrammar holds listed properties to their own
  schema only;
* a ``$ref`` that is not local (``#`` or ``#/...``; ``#anchor``, URLs), ``$dynamicRef``,
  ``$recursiveRef``: xgrammar allows any value there;
* ``oneOf`` whose branches are not plainly disjoint (different types, different ``const`` /
  ``enum`` values, or different ones of a property both require, through local ``$ref``):
  xgrammar enforces such a ``oneOf`` as ``anyOf``, so an output could match two branches.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional

__all__ = ["unenforced_keyword", "structural_tag_schemas", "regex_lookaround"]

_ANNOTATIONS = frozenset(
    ("title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$id")
    + ("$schema", "$defs", "definitions")
)
_ALWAYS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains")
_ALWAYS += ("minContains", "maxContains")
_ALWAYS += ("$dynamicRef", "$recursiveRef")
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPED = _RANGE + ("multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems")
_TYPED += ("minProperties", "maxProperties")
_PY_TYPES = {"string": str, "integer": (int, float), "number": (int, float), "boolean": bool}
_PY_TYPES.update({"null": type(None), "array": list, "object": dict})
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("additionalProperties", "items", "additionalItems", "propertyNames", "unevaluatedProperties")
_ONE += ("unevaluatedItems", "contains", "not", "if", "then", "else")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _why(node: dict, root: Any) -> Optional[tuple[str, str]]:
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
        if any(k in node for k in _RANGE):
            return "multipleOf", "the grammar drops it beside minimum / maximum"
    if "allOf" in node:
        others = set(node) - {"allOf"} - _ANNOTATIONS
        if not isinstance(node["allOf"], list) or len(node["allOf"]) != 1 or others:
            return "allOf", "the grammar merges no subschemas; one alone, beside annotations only, is supported"
    return _why_siblings(node) or _why_string(node) or _why_object(node) or _why_one_of(node, root)


def _why_siblings(node: dict) -> Optional[tuple[str, str]]:
    """Keywords the grammar drops beside ``$ref``, ``anyOf`` / ``oneOf``, ``enum`` / ``const``,
    or without a ``type``."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return "$ref", "only local references (#, #/...) are resolved; the grammar allows any value for it"
    for key in ("$ref", "anyOf", "oneOf"):
        if key in node:
            for other in node:
                if other not in _ANNOTATIONS and other not in (key, "discriminator"):
                    return other, f"the grammar keeps only {key} beside it"
    for key in ("enum", "const"):
        if key in node:
            for other in node:
                if other not in _ANNOTATIONS and other not in (key, "type", "enum", "const"):
                    return other, f"the grammar keeps only {key} beside it"
            values = node[key] if key == "enum" and isinstance(node[key], list) else [node.get(key)]
            if any(_huge_int(v) for v in values):
                return key, "xgrammar writes an integer beyond 64 bits as a float, another value"
            if "type" in node and not all(_has_type(v, node["type"]) for v in values):
                return key, "the grammar allows its values even where they are not of the type"
    if "type" not in node and not any(k in node for k in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
        for key in _TYPED:
            if key in node:
                return key, 'the grammar enforces it only beside a "type"'
    return None


def _huge_int(value: Any) -> bool:
    """True when ``value`` holds an integer outside the signed 64-bit range."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63:
            return True
        stack.extend(v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
    return False


def _has_type(value: Any, types: Any) -> bool:
    types = [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []
    for t in types:
        python = _PY_TYPES.get(t)
        if python is None:
            continue
        if isinstance(value, bool) != (t == "boolean"):
            continue
        if isinstance(value, python) and (t != "integer" or float(value).is_integer()):
            return True
    return False


def _why_string(node: dict) -> Optional[tuple[str, str]]:
    """Length bounds beside ``pattern`` / ``format``, a ``pattern`` with a lookaround."""
    for key in ("format", "pattern"):
        if key in node:
            for other in ("pattern", "minLength", "maxLength"):
                if other != key and other in node:
                    return other, f"the grammar drops it beside {key}"
    if isinstance(node.get("pattern"), str) and regex_lookaround(node["pattern"]):
        return "pattern", "the grammar drops lookahead assertions ((?= / (?!)"
    if isinstance(node.get("pattern"), str) and _json_unsafe(node["pattern"]):
        return "pattern", _UNSAFE
    props = node.get("patternProperties")
    if isinstance(props, dict) and any(_json_unsafe(k) for k in props):
        return "patternProperties", _UNSAFE
    return None


_UNSAFE = (
    'it matches a ", \\ or control character by name, which the grammar writes unescaped (the '
    "output would not be JSON); a range or a negated class that holds it is safe"
)
_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0, "a": 7, "e": 27}


def _char(p: str, i: int) -> tuple[Optional[int], int]:
    """(code point of the one character the regex atom at ``p[i]`` names, or None for a class /
    syntax; the index after it)."""
    if p[i] != "\\":
        return (None if p[i] in "()|*+?{}^$." else ord(p[i])), i + 1
    if i + 1 >= len(p):
        return None, i + 1
    e = p[i + 1]
    if e in _ESCAPES:
        return _ESCAPES[e], i + 2
    if e in "xu":
        width = 2 if e == "x" else 4
        if p[i + 2 : i + 3] == "{":
            end = p.find("}", i)
            digits, after = p[i + 3 : end], end + 1
        else:
            digits, after = p[i + 2 : i + 2 + width], i + 2 + width
        try:
            return int(digits, 16), after
        except ValueError:
            return None, after
    if e == "c":
        return 1, i + 3
    if e.isalnum():  # \d \w \s \b ..., back references
        return None, i + 2
    return ord(e), i + 2


def _needs_escape(c: Optional[int]) -> bool:
    """True for a code point JSON writes escaped in a string: ``"``, a backslash, a control."""
    return c is not None and (c < 0x20 or c in (0x22, 0x5C))


def _json_unsafe(pattern: str) -> bool:
    """True when ``pattern`` names a ``"``, a backslash or a control character (outside a negated
    class, other than inside a range of printable characters): xgrammar's JSON-string grammar
    writes such a character raw, breaking the JSON."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] != "[":
            c, i = _char(pattern, i)
            if _needs_escape(c):
                return True
            continue
        j = i + 1
        negated = pattern[j : j + 1] == "^"
        j += negated
        first = True
        while j < n and (pattern[j] != "]" or first):
            first = False
            c, j = _char(pattern, j)
            if j + 1 < n and pattern[j] == "-" and pattern[j + 1] != "]":
                _, j = _char(pattern, j + 1)
                if not negated and c is not None and c < 0x20:
                    return True
            elif not negated and _needs_escape(c):
                return True
        i = j + 1
    return False


def _why_object(node: dict) -> Optional[tuple[str, str]]:
    """``required`` naming a property not in ``properties`` (the grammar lets the output omit it)."""
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [r for r in required if r not in props]
        if missing:
            return "required", f"{missing[0]!r} is not in properties, and the grammar only requires those"
    props = node.get("properties")
    if not isinstance(props, dict):
        return None
    names = node.get("propertyNames")
    for name in props if isinstance(names, dict) else ():
        if not _name_ok(name, names):
            return (
                "propertyNames",
                f"property {name!r} may break it, and the grammar holds listed properties to nothing",
            )
    patterns = node.get("patternProperties")
    for pattern in patterns if isinstance(patterns, dict) else ():
        for name in props:
            if _search(pattern, name):
                return "patternProperties", (
                    f"{pattern!r} matches property {name!r}, which the grammar holds to its own schema only"
                )
    return None


def _search(pattern: str, name: str) -> bool:
    """True when the regex ``pattern`` matches ``name`` (or Python cannot tell: it does not parse)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True


def _name_ok(name: str, schema: dict) -> bool:
    """True when ``name`` is surely valid under a ``propertyNames`` schema (pattern, min/maxLength,
    const, enum; any other keyword: not sure)."""
    for key, value in schema.items():
        if key in _ANNOTATIONS or (key == "type" and value == "string"):
            continue
        if key == "pattern" and isinstance(value, str):
            try:
                ok = re.search(value, name) is not None
            except re.error:
                ok = False
        elif key in ("minLength", "maxLength") and isinstance(value, int):
            ok = len(name) >= value if key == "minLength" else len(name) <= value
        elif key in ("const", "enum"):
            ok = name == value if key == "const" else isinstance(value, list) and name in value
        else:
            ok = False
        if not ok:
            return False
    return True


def _why_one_of(node: dict, root: Any) -> Optional[tuple[str, str]]:
    """``oneOf`` whose branches are not plainly disjoint (the grammar enforces it as anyOf: an
    output may match two branches)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list):
        return None
    resolved = [_resolve(b, root) for b in branches]
    for i, a in enumerate(resolved):
        for b in resolved[i + 1 :]:
            if not _disjoint(a, b, root):
                return "oneOf", (
                    "its branches are not plainly disjoint (different types, or different const / enum "
                    "values of a required property), and the grammar enforces it as anyOf; use anyOf"
                )
    return None


def _resolve(node: Any, root: Any, depth: int = 0) -> Any:
    """``node`` with a local ``$ref`` followed (a few times at most)."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < 8:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, depth = target, depth + 1
    return node


def _values(node: Any) -> Optional[list]:
    if isinstance(node, dict) and "const" in node:
        return [node["const"]]
    if isinstance(node, dict) and isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _disjoint(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    """True when no JSON value is valid under both (plainly: types, const / enum values, or the
    const / enum values of a property both require, looked for 8 levels deep at most: a
    recursive schema's branches may share themselves)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 8:
        return False
    ta, tb = _type_set(a), _type_set(b)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
        return not any(x == y and type(x) is type(y) for x in va for y in vb)
    pa, pb = a.get("properties"), b.get("properties")
    if isinstance(pa, dict) and isinstance(pb, dict):
        both = set(a.get("required") or []) & set(b.get("required") or []) & set(pa) & set(pb)
        for name in both:
            if _disjoint(_resolve(pa[name], root), _resolve(pb[name], root), root, depth + 1):
                return True
    return False


def _type_set(node: dict) -> Optional[set]:
    t = node.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if types is not None and "number" in types:
        types.add("integer")
    if types is not None and "integer" in types:
        types.add("number")
    return types


def regex_lookaround(pattern: str) -> bool:
    """True when ``pattern`` has a lookahead or lookbehind group outside a character class."""
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return True
        i += 1
    return False


def _children(node: dict, path: str) -> Iterator[tuple[Any, str]]:
    for key in _MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                yield child, f"{path}/{key}/{name}"
    for key in _ONE:
        if isinstance(node.get(key), dict):
            child = node[key]
            if key == "propertyNames" and "type" not in child:
                child = {**child, "type": "string"}  # property names are strings: no type needed
            yield child, f"{path}/{key}"
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
        found = _why(node, schema)
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
