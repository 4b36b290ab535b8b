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
        self.chat = ChatTemplate.find(p if p.is_dir() else p.parent)

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


class ChatTemplate:
    """A Hugging Face chat template (`chat_template.jinja`, or `chat_template` in
    tokenizer_config.json), rendered as transformers renders it: a sandboxed Jinja environment
    with trim_blocks/lstrip_blocks, `raise_exception`, `tojson`, and the special tokens as names."""

    def __init__(self, source: str, special: dict) -> None:
        import json
        from jinja2.sandbox import ImmutableSandboxedEnvironment   # a dependency of torch

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template, self.special = env.from_string(source), special

    @classmethod
    def find(cls, folder: Path) -> Optional["ChatTemplate"]:
        import json
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        source = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").is_file() \
            else cfg.get("chat_template")
        if isinstance(source, list):   # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if v is not None:
                special[key] = v
        return cls(source, special)

    def render(self, messages: list, tools: Optional[list] = None, **kwargs) -> str:
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                    **{**self.special, **kwargs})
