"""Config parsing, rope scaling as transformers computes it, KV budget, and the default model cache."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from loraplex.engine.model.rope import rope_inv_freq

CONVERT = "import sys; from loraplex.engine.model.default_model import ensure_default_model as e; print(e(sys.argv[1]))"
BASE = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}


def hf_inv_freq(raw: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"type": "linear", "factor": 2.0},  # the legacy key
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_inverse_frequencies_match_transformers(scaling):
    raw = dict(BASE, rope_theta=50000.0)
    if scaling is not None:
        raw["rope_scaling"] = scaling
    ours, attention_scaling = rope_inv_freq(ModelConfig.from_hf_dict(raw), max_model_len=128)
    assert attention_scaling == 1.0
    assert torch.equal(ours, hf_inv_freq(raw))


def test_dynamic_rope_is_rescaled_statically_beyond_the_trained_length():
    raw = dict(BASE, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = ModelConfig.from_hf_dict(raw)
    short, _ = rope_inv_freq(config, 128)
    long, _ = rope_inv_freq(config, 512)
    assert torch.all(long <= short) and not torch.equal(long, short)


def test_family_flags_and_defaults():
    qwen2 = ModelConfig.from_hf_dict(dict(BASE, model_type="qwen2", num_key_value_heads=2, eos_token_id=[5, 6]))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.num_key_value_heads == 2
    assert qwen2.eos_token_ids == [5, 6] and qwen2.head_dim == 16
    qwen3 = ModelConfig.from_hf_dict(dict(BASE, model_type="qwen3", head_dim=32, attention_bias=False))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf_dict(dict(BASE, model_type="gpt2"))


def test_kv_pool_size_comes_from_the_memory_budget():
    config = ModelConfig.from_hf_dict(dict(BASE, num_key_value_heads=2))
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, block, kv heads, head dim, float32
    assert EngineConfig(kv_cache_bytes=per_block * 37).resolve_num_blocks(config) == 37
    assert EngineConfig(kv_cache_bytes=per_block * 37, dtype="bfloat16").resolve_num_blocks(config) == 74
    assert EngineConfig(num_blocks=5).resolve_num_blocks(config) == 5


def test_default_model_cache_is_reused_and_loads_in_transformers(smollm_path: Path):
    from transformers import AutoTokenizer

    started = time.monotonic()
    again = ensure_default_model(smollm_path.parent)
    assert again == smollm_path and time.monotonic() - started < 1.0
    assert again.name == DEFAULT_MODEL_NAME
    config = json.loads((again / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert list(again.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(again)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_half_written_cache_is_rebuilt(tmp_path: Path):
    broken = tmp_path / DEFAULT_MODEL_NAME
    broken.mkdir()
    (broken / "config.json").write_text("{")  # an interrupted earlier conversion, no completion marker
    # converting the GGUF holds about a gigabyte for a while: a process of its own gives all of it back
    converted = subprocess.run([sys.executable, "-c", CONVERT, str(tmp_path)], capture_output=True, text=True,
                               timeout=600, check=True)
    path = Path(converted.stdout.strip().splitlines()[-1])
    assert path == broken
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]  # no staging dirs left


def test_cpu_head_for_a_few_rows_equals_the_plain_product_and_keeps_the_argmax() -> None:
    """The CPU LM head takes W @ x.T for small batches (the fast GEMM path); same logits to rounding."""
    from loraplex.engine.model.layers import VocabParallelHead

    torch.manual_seed(0)
    head = VocabParallelHead(64, 1000)
    torch.nn.init.normal_(head.weight)
    for rows in (1, 2, 5, 96, 97, 200):
        hidden = torch.randn(rows, 64)
        logits = head(hidden)
        plain = torch.nn.functional.linear(hidden, head.weight)
        assert logits.shape == (rows, 1000) and logits.is_contiguous()
        torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-4)
        assert torch.equal(logits.argmax(-1), plain.argmax(-1))


def test_a_gguf_header_is_read_once_during_a_conversion_and_gguf_is_left_as_it_was(tmp_path: Path) -> None:
    import gguf
    import numpy as np
    from loraplex.engine.model.gguf_read_once import read_gguf_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with read_gguf_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file by another spelling: the same reader
        assert first.fields["llama.block_count"].contents() == 2
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2).get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_name_map
    assert gguf.GGUFReader(path) is not first


def test_unfilled_model_allocates_every_tensor_in_the_dtype_once_without_importing_sympy() -> None:
    # in a fresh interpreter: whether a module was imported is the point
    code = """
import json, sys, torch
from loraplex.engine.config import ModelConfig
from loraplex.engine.model.llama import unfilled_model
from loraplex.engine.parallel.group import SINGLE_RANK
config = ModelConfig.from_hf_dict(dict(json.loads(sys.argv[1]), tie_word_embeddings=True))
shapes, empty = [], torch.empty
torch.empty = lambda *a, **kw: (lambda t: shapes.append(tuple(t.shape)) or t)(empty(*a, **kw))
model = unfilled_model(config, 64, SINGLE_RANK, torch.bfloat16, "cpu")
torch.empty = empty
table = model.rotary.cos
assert table.dtype == torch.float32 and bool((table[0] == 1).all()), "the rotary tables are not computed"
assert tuple(table.shape) not in shapes, "the rotary tables were allocated empty before being computed"
shard = unfilled_model(config, 64, SINGLE_RANK, torch.bfloat16, "cpu", model.rotary)
assert shard.rotary is model.rotary  # a whole model's tables, shared with its shards
tensors = list(model.parameters()) + list(model.buffers())
assert tensors and all(t.device.type == "cpu" for t in tensors), "a tensor left on meta"
assert {t.dtype for t in model.parameters()} == {torch.bfloat16}
assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()  # the caller ties them
print("sympy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code, json.dumps(BASE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "building the model imported sympy (torch._refs)"
