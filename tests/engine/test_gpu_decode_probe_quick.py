"""The decode probe's --quick mode: its kernels through Triton's interpreter (no GPU needed)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from benchmark_quick import run_quick


def test_gpu_decode_probe_quick() -> None:
    out = run_quick("gpu_decode_probe.py", timeout_s=300, cpu_only=True)
    assert "checked through the Triton interpreter" in out


def _probe_table(name: str) -> ast.expr:
    """A module-level table of the probe, read from its source: importing the probe would set TRITON_INTERPRET in
    this process on a machine without a GPU."""
    tree = ast.parse((Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_decode_probe.py").read_text())
    return next(node.value for node in tree.body if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", None) == name)


def _entry(table: ast.expr, key: str) -> object:
    assert isinstance(table, ast.Dict)
    return ast.literal_eval(next(v for k, v in zip(table.keys, table.values, strict=True)
                                 if k is not None and ast.literal_eval(k) == key))


def test_the_probes_smollm2_shapes_are_the_bundled_models(smollm_path: Path) -> None:
    """`--skinny-model smollm2` and `--lora-gemm-shapes smollm2` sweep the bundled model's layer shapes."""
    config = ast.literal_eval(_probe_table("SMOLLM2_CONFIG"))
    raw = json.loads((smollm_path / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads"):
        assert config[key] == raw[key], key
    h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    head_dim = raw.get("head_dim", h // raw["num_attention_heads"])
    q, kv = raw["num_attention_heads"] * head_dim, raw["num_key_value_heads"] * head_dim
    assert _entry(_probe_table("SKINNY_SHAPES"), "smollm2") == {
        "qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "head": (v, h)}
    assert _entry(_probe_table("LORA_GEMM_SHAPES"), "smollm2") == {
        "qkv": ((q, kv, kv), h), "o": ((h,), q), "gate_up": ((i, i), h), "down": ((h,), i)}
