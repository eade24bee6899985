"""Reading PEFT adapter folders: key names, ranks, alphas, rsLoRA, patterns, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from loraplex.adapters.errors import AdapterRejectedError, UnsafeUploadError
from loraplex.adapters.peft_format import parse_adapter_config, read_peft_adapter
from peft import LoraConfig, get_peft_model
from random_adapters import TINY_HF_CONFIG, write_random_adapter
from transformers import LlamaConfig, LlamaForCausalLM


def _peft_saved(tmp_path: Path, **lora_kwargs) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_HF_CONFIG))
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", model


def _peft_modules(model) -> dict[tuple[int, str], torch.nn.Module]:  # type: ignore[no-untyped-def]
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            parts = name.split(".")
            out[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return out


def test_matches_peft_scaling_with_rank_and_alpha_patterns(tmp_path, spec):
    folder, model = _peft_saved(
        tmp_path,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 2},
        alpha_pattern={"down_proj": 3},
    )
    weights = read_peft_adapter(folder, "adp_1", spec)
    peft_modules = _peft_modules(model)
    assert set(weights.modules) == set(peft_modules)
    for key, module in peft_modules.items():
        ours = weights.modules[key]
        assert ours.scaling == pytest.approx(module.scaling["default"])
        torch.testing.assert_close(ours.lora_a, module.lora_A["default"].weight)
        torch.testing.assert_close(ours.lora_b, module.lora_B["default"].weight)
    assert weights.modules[(1, "q_proj")].lora_a.shape == (2, 64)
    assert weights.modules[(0, "v_proj")].lora_b.shape == (32, 4)
    assert weights.rank == 8


def test_rslora_and_regex_target_modules(tmp_path, spec):
    folder, model = _peft_saved(
        tmp_path, r=16, lora_alpha=8, use_rslora=True, target_modules=r".*\.layers\.1\.mlp\.(gate|up)_proj"
    )
    weights = read_peft_adapter(folder, "adp_2", spec)
    assert set(weights.modules) == {(1, "gate_proj"), (1, "up_proj")}
    for key, module in _peft_modules(model).items():
        assert weights.modules[key].scaling == pytest.approx(8 / math.sqrt(16))
        assert module.scaling["default"] == pytest.approx(8 / math.sqrt(16))


def test_trained_adapters_read_with_their_ranks(trained_adapters, smollm_spec):
    pirate = read_peft_adapter(trained_adapters["pirate"], "pirate", smollm_spec)
    assert pirate.rank == 8 and {m for _, m in pirate.modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    upper = read_peft_adapter(trained_adapters["upper"], "upper", smollm_spec)
    assert upper.modules[(3, "down_proj")].lora_a.shape == (8, 1536)
    assert upper.modules[(3, "down_proj")].scaling == pytest.approx(32 / 8)
    assert upper.modules[(3, "up_proj")].scaling == pytest.approx(16 / 16)
    thinker = read_peft_adapter(trained_adapters["thinker"], "thinker", smollm_spec)
    assert thinker.modules[(0, "q_proj")].scaling == pytest.approx(8 / 2)
    assert len(thinker.modules) == 30 * 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "only LORA"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["lm_head"]}, "not supported"),
        ({"r": 0}, "r must be a positive integer"),
        ({"rank_pattern": {"q_proj": "x"}}, "rank_pattern"),
        ({"target_modules": "(["}, "does not compile"),
    ],
)
def test_unsupported_configs_refused_with_reason(tmp_path, spec, change, message):
    folder = write_random_adapter(tmp_path / "a", spec)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(change)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRejectedError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_peft_adapter(folder, "x", spec)


def test_malformed_json_refused():
    with pytest.raises(UnsafeUploadError, match="not valid JSON"):
        parse_adapter_config(b'{"r": 8,')
    with pytest.raises(UnsafeUploadError, match="JSON object"):
        parse_adapter_config(b"[1, 2]")


def test_wrong_shape_names_layer_module_and_shapes(tmp_path, spec):
    folder = write_random_adapter(tmp_path / "a", spec, r=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["rank_pattern"] = {"layers.1.self_attn.q_proj": 16}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRejectedError, match=r"layer 1 q_proj lora_A has shape \[8, 64\], expected \[16, 64\]"):
        read_peft_adapter(folder, "x", spec)


def test_missing_tensor_named(tmp_path, spec):
    from safetensors.torch import load_file, save_file

    folder = write_random_adapter(tmp_path / "a", spec)
    tensors = load_file(folder / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterRejectedError, match="layer 1 v_proj lora_B is missing"):
        read_peft_adapter(folder, "x", spec)


def test_other_base_model_refused_by_shape(tmp_path, spec, smollm_spec):
    folder = write_random_adapter(tmp_path / "a", spec)
    with pytest.raises(AdapterRejectedError, match=r"trained for 'tiny-llama'.*layer 0 q_proj lora_A has shape"):
        read_peft_adapter(folder, "x", smollm_spec)
