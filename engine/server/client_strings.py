"""The strings a client sends, checked at the edge before any handler sees them: JSON bodies (keys
and values, however deep), the headers and query parameters the routes read.

* A lone UTF-16 surrogate (`"\\ud800"` is valid JSON) has no UTF-8 form: the tokenizer, a seed's
  hash and the step log all encode strings, and one such rid had ended the engine. Refused
  everywhere.
* NUL (U+0000) is refused in identifiers and parameters (rid, stop strings, names, paths), where no
  client means it and C-string consumers (logs, file systems) cut at it. In prompt content (the
  values of `CONTENT_KEYS`, and everything under `TEXT_TREES`) it is text like any other and is served.
* Outside content a string has at most `STRING_MAX_CHARS` characters; content is bounded by the body
  limit (413) and the context length.

The error names the field by its path (`messages[0].content`, `sampling_params.stop[1]`) and the
offending character's position; the string itself is never echoed."""
from __future__ import annotations

import re
from typing import Any, Optional

from .protocol import BadRequest

STRING_MAX_CHARS = 4096
# keys whose strings (and everything below them) are prompt content, not identifiers
CONTENT_KEYS = frozenset({"text", "prompt", "content", "reasoning_content", "arguments", "serialized_named_tensors"})
TEXT_TREES = frozenset({"tools"})   # every string below is content (a tool's schema is rendered into the prompt)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _problem(s: str, content: bool) -> Optional[str]:
    m = _SURROGATE.search(s)
    if m is not None:
        return f"contains a lone UTF-16 surrogate (U+{ord(m.group()):04X}) at character {m.start()}"
    if not content:
        nul = s.find("\x00")
        if nul >= 0:
            return f"contains a NUL character (U+0000) at character {nul}"
        if len(s) > STRING_MAX_CHARS:
            return f"is {len(s)} characters long; at most {STRING_MAX_CHARS} are accepted"
    return None


def check_body(body: Any) -> None:
    """BadRequest naming the first bad string of a parsed JSON body (dict keys included)."""
    # content: False, "own" (this value and its list items are content, a dict below names its own
    # keys: a content part's "type" is not text), or "tree" (everything below)
    stack: list[tuple[Any, str, Any]] = [(body, "", False)]
    while stack:
        value, path, content = stack.pop()
        if isinstance(value, str):
            why = _problem(value, bool(content))
            if why is not None:
                raise BadRequest(f"{path or 'body'} {why}")
        elif isinstance(value, dict):
            for k, v in value.items():
                why = _problem(k, False)
                if why is not None:
                    raise BadRequest(f"a key of {path or 'the body'} {why}")
                below = "tree" if content == "tree" or k in TEXT_TREES else ("own" if k in CONTENT_KEYS else False)
                stack.append((v, f"{path}.{k}" if path else str(k), below))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", content) for i, v in enumerate(value))


def check_value(where: str, value: Optional[str]) -> Optional[str]:
    """A header or query parameter (an identifier): `value`, or BadRequest naming `where`."""
    if value is not None:
        why = _problem(value, False)
        if why is not None:
            raise BadRequest(f"{where} {why}")
    return value


def header(request, name: str) -> Optional[str]:
    """A request header a route reads; aiohttp decodes bytes that are not UTF-8 as lone surrogates."""
    return check_value(f"header {name}", request.headers.get(name))


def query(request, name: str, default: Optional[str] = None) -> Optional[str]:
    return check_value(f"query parameter {name}", request.query.get(name, default))
