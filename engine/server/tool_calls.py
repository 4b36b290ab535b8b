"""Tool calls out of a chat answer's text: Qwen 2.5 / Qwen 3's format (SGLang's `--tool-call-parser
qwen25`, alias `qwen`), one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose JSON parses to an object with a string `name` naming one of the request's tools
becomes an OpenAI tool call (`arguments` re-serialized as a JSON string; SGLang also accepts
`parameters`); any other block stays in the content as the model wrote it, so nothing is lost.
`ToolStream` does the same on a stream: text goes out as it comes except from a `<tool_call>` on
(or a piece of one at the end), held until its block closes. Pure: no engine, no aiohttp."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("qwen25", "qwen")


def tool_names(tools: Optional[list]) -> set[str]:
    out = set()
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.add(fn["name"])
    return out


def _call(block: str, names: set[str], index: int) -> Optional[dict]:
    """The OpenAI tool call a block's inside makes, or None."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "index": index, "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def _held_from(text: str) -> int:
    """Where text stops being safe to send: at a `<tool_call>`, or at a tail that may begin one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def parse(text: str, tools: Optional[list]) -> tuple[Optional[str], list[dict]]:
    """(content, tool calls) of a whole answer; content None when only tool calls remain."""
    stream = ToolStream(tools)
    content, calls = stream.feed(text)
    content = (content + stream.finish()).strip()
    return (content or None) if calls else content, calls


@dataclass
class ToolStream:
    """Feed the answer's text as it grows (only the new part); each call returns the content to send
    now and the tool calls completed by it."""
    tools: Optional[list]
    held: str = ""
    calls: int = 0
    names: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.names = tool_names(self.tools)

    def feed(self, new: str) -> tuple[str, list[dict]]:
        self.held += new
        out, calls = "", []
        while True:
            at = _held_from(self.held)
            out, self.held = out + self.held[:at], self.held[at:]
            if not self.held.startswith(OPEN):
                return out, calls
            end = self.held.find(CLOSE)
            if end < 0:
                return out, calls
            block, self.held = self.held[:end + len(CLOSE)], self.held[end + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)].strip(), self.names, self.calls)
            if call is None:
                out += block
            else:
                calls.append(call)
                self.calls += 1
                self.held = self.held.lstrip("\n")   # the separator between blocks

    def finish(self) -> str:
        """What is still held (an unclosed block, a partial tag) goes out as content."""
        rest, self.held = self.held, ""
        return rest
