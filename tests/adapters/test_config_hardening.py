"""Hostile adapter_config.json and safetensors headers: a clear refusal naming the field, never a crash."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from loraplex.adapters.errors import AdapterRejectedError, UnsafeUploadError
from loraplex.adapters.peft_format import parse_adapter_config
from loraplex.adapters.regex_safety import check_safe_regex
from loraplex.adapters.safetensors_header import read_safetensors_header

BASE = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


def config(**changes: object) -> bytes:
    return json.dumps({**BASE, **changes}).encode()


@pytest.mark.parametrize("pattern", [
    ".*\\.(q_proj|v_proj)", ".*decoder.*(self_attn|encoder_attn).*(q_proj|v_proj)$",
    "model\\.layers\\.\\d+\\.self_attn\\.(q|k|v)_proj",
])
def test_ordinary_peft_regexes_pass(pattern):
    assert parse_adapter_config(config(target_modules=pattern)).target_modules == pattern


@pytest.mark.parametrize(("pattern", "reason"), [
    ("(a+)+$", "nests repeats"),
    ("(.*)*q_proj", "nests repeats"),
    ("(x|x)*y", "repeats an alternation"),
    ("(\\w+)\\1", "back-reference"),
    (".*.*.*.*q_proj", "unbounded repeats"),
    ("q" * 300, "characters long"),
    ("(unclosed", "does not compile"),
])
def test_catastrophic_or_oversized_regexes_are_refused(pattern, reason):
    for field in ("target_modules", "exclude_modules"):
        with pytest.raises(AdapterRejectedError, match=reason):
            parse_adapter_config(config(**{field: pattern}))
    with pytest.raises(AdapterRejectedError, match=reason):
        parse_adapter_config(config(rank_pattern={pattern: 4}))


def test_the_refused_patterns_are_really_slow_in_re():
    """Why the checks exist: one of them, matched as PEFT would, against one module name."""
    import re

    start = time.perf_counter()
    re.fullmatch("(a+)+$", "a" * 22 + "!")
    assert time.perf_counter() - start > 0.05
    with pytest.raises(AdapterRejectedError):
        check_safe_regex("(a+)+$", "target_modules")


@pytest.mark.parametrize(("raw", "error", "reason"), [
    (b'{"r": ' + b"9" * 5000 + b"}", UnsafeUploadError, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, UnsafeUploadError, "not valid JSON"),
    (config(lora_alpha=10**400), AdapterRejectedError, "lora_alpha"),
    (config(rank_pattern={"q_proj": 10**400}), AdapterRejectedError, "rank_pattern"),
    (config(alpha_pattern={"q_proj": 10**30}), AdapterRejectedError, "alpha_pattern"),
    (config(base_model_name_or_path=5), AdapterRejectedError, "base_model_name_or_path"),
    (config(base_model_name_or_path=["x"]), AdapterRejectedError, "base_model_name_or_path"),
    (config(target_modules=[1, 2]), AdapterRejectedError, "target_modules"),
    (config(layers_to_transform=[True]), AdapterRejectedError, "layers_to_transform"),
    (config(r="8"), AdapterRejectedError, "r must be"),
])
def test_hostile_config_values_get_a_clear_refusal(raw, error, reason):
    with pytest.raises(error, match=reason):
        parse_adapter_config(raw)


def _safetensors(tmp_path: Path, header: bytes, data: bytes = b"") -> Path:
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header", [
    b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, ' + b"1" * 4000 + b"]}}",
    b'{"a": {"dtype": "F32", "shape": [' + b"4294967296, " * 8 + b'1], "data_offsets": [0, 4]}}',
    b'{"a": "x"}',
    b"[" * 50_000,
])
def test_hostile_safetensors_headers_are_refused(tmp_path, header):
    with pytest.raises(UnsafeUploadError):
        read_safetensors_header(_safetensors(tmp_path, header, b"\0" * 4))
