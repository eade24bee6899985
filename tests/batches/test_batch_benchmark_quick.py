"""benchmarks/batch.py --quick runs (a benchmark that rots fails the suite)."""

from __future__ import annotations

from benchmark_quick import run_quick


def test_batch_benchmark_quick() -> None:
    out = run_quick("batch.py", timeout_s=1500)
    assert "batch_over_online_throughput" in out and "greedy_equal_fraction" in out
    assert "lost_or_duplicated_on_restart" not in out  # quick runs leave the restart to test_batch_restart.py


def test_body_shape_keeps_the_tokenizer_and_takes_the_published_layer_shapes(tmp_path) -> None:
    """--body-shape: the served folder has the bundled tokenizer (its vocabulary, so every prompt's ids are in
    range) and Llama-3.1-8B's layers; its figures' suffix is derived from the name."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from loraplex.adapters.base_model import BaseModelSpec
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.model.default_model import ensure_default_model

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("batch_benchmark", root / "benchmarks" / "batch.py")
    batch = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = batch
    spec.loader.exec_module(batch)
    source = ensure_default_model(root / "data" / "models")
    folder = batch.body_shaped_model(source, "Llama-3.1-8B", tmp_path)
    config = ModelConfig.from_pretrained(folder)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 14336, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.vocab_size == ModelConfig.from_pretrained(source).vocab_size
    assert not config.tie_word_embeddings and config.rope_theta == 500000.0
    assert (folder / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not list(folder.glob("*.safetensors"))  # random weights: nothing to read
    shapes = BaseModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()), name=folder.name)
    assert shapes.module_shapes["v_proj"] == (4096, 1024)  # the adapters uploaded are of this body
    assert batch.shape_suffix("Llama-3.1-8B") == "_llama_3_1_8b"
