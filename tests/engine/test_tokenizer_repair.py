"""A byte-level BPE tokenizer that a GGUF conversion wrote with SentencePiece decoding (as transformers 5.17 did
for the bundled model) is repaired: grammar masks read token bytes from it, and broken, a JSON schema refused
the model's ` "` after `{"name":`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loraplex.engine.model.tokenizer_repair import needs_repair, repair_byte_level_tokenizer
from loraplex.grammar.compiler import GrammarCompilerService
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from token_bitmask import allowed_token_ids
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SPACE_QUOTE = " \""


def as_transformers_5_17_wrote_it(good: dict) -> dict:
    broken = json.loads(json.dumps(good))
    broken["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<|endoftext|>")
    broken["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, good["decoder"]]}
    broken["normalizer"] = {"type": "Sequence", "normalizers": []}
    return broken


def allowed_after(model_dir: Path, text: str) -> set[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    service = GrammarCompilerService(tokenizer, len(tokenizer))
    try:
        matcher = service.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA)).new_matcher()
        assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        bitmask = torch.zeros((1, (len(tokenizer) + 31) // 32), dtype=torch.int32)
        matcher.fill_bitmask(bitmask, 0)
        return set(allowed_token_ids(bitmask[0], len(tokenizer)))
    finally:
        service.close()


@pytest.fixture
def broken_copy(smollm_path: Path, tmp_path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        shutil.copy(smollm_path / name, tmp_path / name)
    good = json.loads((smollm_path / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer.json").write_text(json.dumps(as_transformers_5_17_wrote_it(good)), encoding="utf-8")
    return tmp_path


def test_the_repaired_tokenizer_gives_the_grammar_the_bytes_the_model_means(smollm_path: Path,
                                                                             broken_copy: Path) -> None:
    space_quote = AutoTokenizer.from_pretrained(smollm_path).encode(SPACE_QUOTE, add_special_tokens=False)
    assert len(space_quote) == 1
    assert space_quote[0] not in allowed_after(broken_copy, '{"name":'), "the broken file shows the bug"
    assert repair_byte_level_tokenizer(broken_copy / "tokenizer.json")
    assert space_quote[0] in allowed_after(broken_copy, '{"name":')
    assert allowed_after(broken_copy, '{"name":') == allowed_after(smollm_path, '{"name":')
    text = 'Ünïcode, "quotes" and  spaces\n{"a": 1}'
    assert (AutoTokenizer.from_pretrained(broken_copy).encode(text)
            == AutoTokenizer.from_pretrained(smollm_path).encode(text))


def test_a_right_tokenizer_is_left_alone_and_the_repair_is_idempotent(smollm_path: Path, broken_copy: Path) -> None:
    good = json.loads((smollm_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert not needs_repair(good)
    assert repair_byte_level_tokenizer(broken_copy / "tokenizer.json")
    assert not repair_byte_level_tokenizer(broken_copy / "tokenizer.json")
    assert not needs_repair({"model": {"type": "Unigram"}, "pre_tokenizer": {"type": "Metaspace"}})
