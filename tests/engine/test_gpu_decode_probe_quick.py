"""The decode probe's --quick mode: its kernels through Triton's interpreter (no GPU needed)."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_gpu_decode_probe_quick() -> None:
    out = run_quick("gpu_decode_probe.py", timeout_s=300)
    assert "checked through the Triton interpreter" in out


def test_the_probes_smollm2_shapes_are_the_bundled_models(smollm_path) -> None:
    """`--skinny-model smollm2` and `--lora-gemm-shapes smollm2` sweep the bundled model's layer shapes."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_decode_probe as probe

    raw = json.loads((smollm_path / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads"):
        assert probe.SMOLLM2_CONFIG[key] == raw[key], key
    h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    head_dim = raw.get("head_dim", h // raw["num_attention_heads"])
    q, kv = raw["num_attention_heads"] * head_dim, raw["num_key_value_heads"] * head_dim
    assert probe.SKINNY_SHAPES["smollm2"] == {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h),
                                              "down": (h, i), "head": (v, h)}
    assert probe.LORA_GEMM_SHAPES["smollm2"] == {"qkv": ((q, kv, kv), h), "o": ((h,), q), "gate_up": ((i, i), h),
                                                 "down": ((h,), i)}
