"""Stop strings with SGLang's semantics, on the server (the engine works on token ids; the tokenizer
lives here). `sampling_params.stop` (a string or a list) ends a request at the first token after
which the decoded output contains one of them: that token is the last of `output_ids`, and
`finish_reason` is `{"type": "stop", "matched": "<the string>"}`. The text is cut before the match
(SGLang's default), keeps the match with `include_stop_str_in_output`, or is left whole with
`no_stop_trim`. The engine is told to abort the request, so its KV is freed at the next step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .protocol import BadRequest

# Each new token decodes the last `window` tokens against every string on the event loop every
# request shares: bounds that keep one request's stops from slowing the others' outputs.
STOP_MAX_STRINGS = 64
STOP_MAX_CHARS = 1024


@dataclass(frozen=True)
class StopStrings:
    strings: tuple[str, ...]
    decode: Callable[[list[int]], str]
    include: bool = False        # include_stop_str_in_output
    no_trim: bool = False        # no_stop_trim

    @property
    def window(self) -> int:
        # Tokens decoded per check: every token decodes to >= 1 byte, so a match of L bytes lies
        # within the last L tokens; one more for a character split over two tokens.
        return max(len(s.encode()) for s in self.strings) + 1

    def first_match(self, before: list[int], new: list[int]) -> Optional[tuple[int, str]]:
        """(how many of `new` to keep, the matched string) for the first token of `new` after which
        the output contains a stop string, or None."""
        ids = before + new
        for j in range(len(before), len(ids)):
            tail = self.decode(ids[max(0, j + 1 - self.window): j + 1])
            for s in self.strings:
                if s in tail:
                    return j + 1 - len(before), s
        return None

    def trim(self, text: str, matched: str) -> str:
        if self.no_trim:
            return text
        pos = text.find(matched)
        if pos < 0:
            return text
        return text[:pos + len(matched)] if self.include else text[:pos]


def take_stop_strings(sp: dict, tokenizer, where: str = "") -> tuple[dict, Optional[StopStrings]]:
    """Splits the stop-string keys off a request's `sampling_params` (the rest goes to the engine)."""
    sp = dict(sp)
    stop = sp.pop("stop", None)
    include = sp.pop("include_stop_str_in_output", False)
    if not isinstance(include, bool):
        raise BadRequest(f"{where}sampling_params.include_stop_str_in_output must be a boolean, got {include!r}")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None or stop == []:
        return sp, None
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"{where}sampling_params.stop must be a string or a list of strings, got {stop!r}")
    if len(stop) > STOP_MAX_STRINGS:
        raise BadRequest(f"{where}sampling_params.stop has {len(stop)} strings; at most {STOP_MAX_STRINGS}")
    for i, s in enumerate(stop):
        if not s:
            raise BadRequest(f"{where}sampling_params.stop[{i}] is an empty string")
        if len(s) > STOP_MAX_CHARS:
            raise BadRequest(f"{where}sampling_params.stop[{i}] is {len(s)} characters long; at most {STOP_MAX_CHARS}")
    if tokenizer is None:
        raise BadRequest(f"{where}sampling_params.stop needs a tokenizer (start the server with --tokenizer DIR, "
                         "or use stop_token_ids)")
    no_trim = sp.get("no_stop_trim", False)
    if not isinstance(no_trim, bool):
        raise BadRequest(f"{where}sampling_params.no_stop_trim must be a boolean, got {no_trim!r}")
    return sp, StopStrings(tuple(dict.fromkeys(stop)), tokenizer.decode, include, no_trim)
