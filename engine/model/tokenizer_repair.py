"""Repair of a byte-level BPE tokenizer that a GGUF conversion wrote with SentencePiece decoding.

Some transformers releases (5.17 was seen; 5.24 is right) convert a GGUF's byte-level BPE tokenizer
(`tokenizer.ggml.model = gpt2`, SmolLM2's) into a `tokenizer.json` whose model has `byte_fallback` on and
whose decoder is SentencePiece's (byte fallback, fuse, `▁` replaced by a space) in front of the byte-level
one. Text round-trips, but grammar backends read the file to learn each token's bytes, and with byte fallback
on they take byte-level tokens (`Ġ"` for ` "`) literally: after `{"name":` a JSON-schema grammar allowed one
token instead of 29, and the model's ` "` was refused with an error. Byte-level BPE covers every byte by
construction and has no use for byte fallback, so the file is put back to plain byte-level decoding.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def repair_byte_level_tokenizer(tokenizer_json: Path) -> bool:
    """Rewrite `tokenizer_json` in place if it is a byte-level BPE with SentencePiece decoding; True if it was."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    if not needs_repair(data):
        return False
    model = data["model"]
    model["byte_fallback"] = False
    model["fuse_unk"] = False
    model["unk_token"] = None
    data["decoder"] = dict(BYTE_LEVEL_DECODER)
    if data.get("normalizer") == {"type": "Sequence", "normalizers": []}:
        data["normalizer"] = None
    fd, temp = tempfile.mkstemp(prefix=".tokenizer-", dir=tokenizer_json.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(data, out, ensure_ascii=False)
    os.replace(temp, tokenizer_json)
    return True


def needs_repair(data: dict[str, Any]) -> bool:
    """A BPE model behind a byte-level pre-tokenizer that decodes or falls back as SentencePiece does."""
    pre = data.get("pre_tokenizer") or {}
    model = data.get("model") or {}
    if pre.get("type") != "ByteLevel" or model.get("type") != "BPE":
        return False
    decoder = data.get("decoder") or {}
    return bool(model.get("byte_fallback")) or decoder.get("type") != "ByteLevel"
