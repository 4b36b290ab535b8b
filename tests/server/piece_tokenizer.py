"""A tokenizer built here for the tiny model (no hub download): pieces of 1-4 characters over a small
alphabet, byte-free BPE whose decode is the pieces' concatenation, so a string spans tokens and ends
inside them. The model directory gets the checkpoint's files beside it."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

ALPHABET = "abcdef "


def piece_model(checkpoint: Path, dest: Path, *, extra: str = "", chat_template: str | None = None):
    """`dest` holds the checkpoint and the tokenizer (the alphabet, then `extra`'s characters as pieces
    of their own, then random pieces up to the vocabulary); returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    for f in checkpoint.iterdir():
        shutil.copy(f, dest / f.name)
    vocab_size = json.loads((dest / "config.json").read_text())["vocab_size"]
    rng, pieces = random.Random(0), list(ALPHABET + extra)
    while len(pieces) < vocab_size:
        p = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 4)))
        if p not in pieces:
            pieces.append(p)
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token=None))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(dest)
    return fast
