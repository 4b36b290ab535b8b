"""Optional text support: with a Hugging Face `tokenizer.json` (the model directory's, or
`--tokenizer`), `/generate` and `/v1/completions` accept text prompts and return decoded text.
Without one the server works on token ids only and `text` is ""."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger("pdrollout.server")


class TextTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer   # ships with transformers; needed only for text

        p = Path(path)
        self.path = str(p)
        self._tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def find_tokenizer(model_dir: str, explicit: Optional[str]) -> Optional[TextTokenizer]:
    if explicit:
        return TextTokenizer(explicit)
    if (Path(model_dir) / "tokenizer.json").is_file():
        try:
            return TextTokenizer(model_dir)
        except ImportError:
            log.warning("%s has tokenizer.json but the `tokenizers` package is missing: token ids only",
                        model_dir)
    return None
