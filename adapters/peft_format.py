"""Read what PEFT's `save_pretrained` writes for a LoRA adapter into `AdapterWeights`.

`adapter_config.json` carries r, lora_alpha, use_rslora, target_modules (a list
of name suffixes or one regex), and per-module rank/alpha patterns; the
tensors are named like `base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight`.
Only safetensors is read; pickled weights are never opened. Features we do not
serve (DoRA, biases, extra trainable modules...) are refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loraplex.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec
from loraplex.adapters.errors import AdapterRejectedError, UnsafeUploadError
from loraplex.adapters.regex_safety import MAX_UNBOUNDED_REPEATS, check_safe_regex
from loraplex.adapters.safetensors_header import read_safetensors_header
from loraplex.engine.interfaces import AdapterWeights, LoRAModuleWeights
from safetensors import safe_open

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_MAX_NUMBER = 1e9            # ranks and alphas are small; a huge one is a mistake or an attack
_MAX_PATTERNS = 1024         # rank_pattern / alpha_pattern entries, layers_to_transform items
_MAX_BASE_MODEL_NAME = 500   # the registry's column

_TENSOR_KEY = re.compile(
    r"^base_model\.model\.(?P<path>(?:.+\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[A-Za-z_]+))"
    r"\.lora_(?P<which>[AB])\.weight$"
)
# Config flags that change the math or add weights we do not serve, with the reason given back.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D-style weights) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "use_qalora": "QA-LoRA adapters are not supported",
    "megatron_config": "Megatron-parallel adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
}


@dataclass(frozen=True, slots=True)
class PeftLoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # name suffixes, or one regex matched against the full module name
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    exclude_modules: tuple[str, ...] | str = ()

    def targets(self, module_path: str) -> bool:
        return _matches(self.target_modules, module_path) and not _matches(self.exclude_modules, module_path)

    def rank_for(self, module_path: str) -> int:
        key = _pattern_key(self.rank_pattern, module_path)
        return self.r if key is None else self.rank_pattern[key]

    def alpha_for(self, module_path: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_path)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling_for(self, module_path: str) -> float:
        rank, alpha = self.rank_for(module_path), self.alpha_for(module_path)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def target_module_names(self, layer: int = 0) -> list[str]:
        """The supported module names this config adapts in one layer (for listings and completeness)."""
        return [m for m in SUPPORTED_MODULES if self.targets(module_path(layer, m))]


def module_path(layer: int, module: str) -> str:
    """The module's full name inside a Llama-family model, as PEFT matches patterns against it."""
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{block}.{module}"


def _matches(names: tuple[str, ...] | str, module_path: str) -> bool:
    # PEFT's rule: a string is a regex over the full name; a list matches by name suffix.
    if isinstance(names, str):
        return re.fullmatch(names, module_path) is not None
    return any(module_path == t or module_path.endswith("." + t) for t in names)


def _pattern_key(patterns: dict, module_path: str) -> str | None:
    # PEFT's rule (peft.utils.other.get_pattern_key): first key K with re.match(rf"(.*\.)?({K})$", path).
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return None


def parse_adapter_config(raw: bytes) -> PeftLoraConfig:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also integers of 4,300+ digits
        raise UnsafeUploadError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UnsafeUploadError("adapter_config.json must hold a JSON object")
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterRejectedError(f"peft_type {peft_type!r} is not supported; only LORA adapters are served")
    for flag, reason in _UNSUPPORTED_FLAGS.items():
        if data.get(flag):
            raise AdapterRejectedError(reason)
    if data.get("bias", "none") != "none":
        raise AdapterRejectedError(f"bias={data['bias']!r} is not supported; only bias='none'")
    r, alpha = data.get("r"), data.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterRejectedError(f"adapter_config.json: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 < alpha <= _MAX_NUMBER:
        raise AdapterRejectedError(f"adapter_config.json: lora_alpha must be a positive number, got {alpha!r}")
    base_model = data.get("base_model_name_or_path")
    if base_model is not None and (not isinstance(base_model, str) or len(base_model) > _MAX_BASE_MODEL_NAME):
        raise AdapterRejectedError(
            f"adapter_config.json: base_model_name_or_path must be a string of at most {_MAX_BASE_MODEL_NAME} "
            "characters"
        )
    return PeftLoraConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(data.get("use_rslora", False)),
        target_modules=_target_modules(data.get("target_modules")),
        rank_pattern=_pattern(data.get("rank_pattern"), "rank_pattern", int),
        alpha_pattern=_pattern(data.get("alpha_pattern"), "alpha_pattern", float),
        base_model_name_or_path=base_model or None,
        layers_to_transform=_layers(data.get("layers_to_transform")),
        exclude_modules=_exclude_modules(data.get("exclude_modules")),
    )


def _exclude_modules(value: object) -> tuple[str, ...] | str:
    if value is None or value == []:
        return ()
    if isinstance(value, str):
        check_safe_regex(value, "exclude_modules")
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterRejectedError(f"exclude_modules must be a list of names or a regex, got {value!r}")


def _target_modules(value: object) -> tuple[str, ...] | str:
    if isinstance(value, str):
        check_safe_regex(value, "target_modules")
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        unsupported = sorted(set(value) - set(SUPPORTED_MODULES))
        if unsupported:
            raise AdapterRejectedError(
                f"target_modules {unsupported} are not supported; supported: {list(SUPPORTED_MODULES)}"
            )
        return tuple(value)
    raise AdapterRejectedError(f"target_modules must be a non-empty list of names or a regex, got {value!r}")


def _pattern(value: object, name: str, kind: type) -> dict:
    if value in (None, {}):
        return {}
    if not isinstance(value, dict):
        raise AdapterRejectedError(f"{name} must be an object, got {type(value).__name__}")
    if len(value) > _MAX_PATTERNS:
        raise AdapterRejectedError(f"{name} has {len(value)} entries (at most {_MAX_PATTERNS})")
    out = {}
    for key, v in value.items():
        # Matched as `(.*\.)?(KEY)$`: the wrapper spends one of the unbounded repeats a pattern may have.
        check_safe_regex(key, f"{name} key", max_unbounded=MAX_UNBOUNDED_REPEATS - 1)
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v <= _MAX_NUMBER:
            raise AdapterRejectedError(f"{name}[{key!r}] must be a positive number, got {v!r}")
        out[key] = kind(v)
    return out


def _layers(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and len(value) <= _MAX_PATTERNS and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise AdapterRejectedError(f"layers_to_transform must be an integer or a list of integers, got {value!r}")


@dataclass(frozen=True, slots=True)
class TensorKey:
    layer: int
    module: str
    which: str  # "A" or "B"
    path: str   # the module's full name, e.g. model.layers.7.self_attn.q_proj


def parse_tensor_key(name: str) -> TensorKey:
    if "lora_magnitude_vector" in name:
        raise AdapterRejectedError("DoRA adapters (lora_magnitude_vector) are not supported")
    if "lora_embedding" in name:
        raise AdapterRejectedError(f"embedding LoRA ({name}) is not supported")
    match = _TENSOR_KEY.match(name)
    if match is None:
        raise AdapterRejectedError(f"unexpected tensor {name!r}; expected PEFT LoRA weights of a decoder layer")
    module = match["module"]
    if module not in SUPPORTED_MODULES:
        raise AdapterRejectedError(f"tensor {name!r} adapts {module}, which is not supported")
    return TensorKey(int(match["layer"]), module, match["which"], match["path"])


def expected_shape(spec: BaseModelSpec, key: TensorKey, rank: int) -> tuple[int, int]:
    in_features, out_features = spec.module_shapes[key.module]
    return (rank, in_features) if key.which == "A" else (out_features, rank)


def read_peft_adapter(
    folder: Path, adapter_id: str, spec: BaseModelSpec, *, dtype: torch.dtype = torch.float32
) -> AdapterWeights:
    """Load an adapter folder, checking every tensor's name and shape against the served model."""
    for path in folder.iterdir():
        if path.name.endswith(PICKLE_SUFFIXES):
            raise UnsafeUploadError(f"{path.name}: pickled weights are refused; upload adapter_model.safetensors")
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_path.is_file():
        raise AdapterRejectedError(f"{CONFIG_NAME} is missing")
    if not weights_path.is_file():
        raise AdapterRejectedError(f"{WEIGHTS_NAME} is missing")
    config = parse_adapter_config(config_path.read_bytes())
    return load_checked_weights(config, weights_path, adapter_id, spec, dtype=dtype)


def load_checked_weights(
    config: PeftLoraConfig, weights_path: Path, adapter_id: str, spec: BaseModelSpec, *, dtype: torch.dtype
) -> AdapterWeights:
    entries = read_safetensors_header(weights_path)
    keys = {name: parse_tensor_key(name) for name in entries}
    _check_shapes(config, entries, keys, spec)
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for name, key in keys.items():
            modules.setdefault((key.layer, key.module), {})[key.which] = f.get_tensor(name).to(dtype)
    weights: dict[tuple[int, str], LoRAModuleWeights] = {}
    for (layer, module), pair in sorted(modules.items()):
        path = next(k.path for k in keys.values() if (k.layer, k.module) == (layer, module))
        weights[(layer, module)] = LoRAModuleWeights(
            lora_a=pair["A"].contiguous(), lora_b=pair["B"].contiguous(), scaling=config.scaling_for(path)
        )
    rank = max(w.lora_a.shape[0] for w in weights.values())
    return AdapterWeights(adapter_id=adapter_id, rank=rank, modules=weights)


def _check_shapes(config: PeftLoraConfig, entries: dict, keys: dict[str, TensorKey], spec: BaseModelSpec) -> None:
    if not keys:
        raise AdapterRejectedError(f"{WEIGHTS_NAME} holds no LoRA tensors")
    mismatch_hint = ""
    if config.base_model_name_or_path and not spec.matches_name(config.base_model_name_or_path):
        mismatch_hint = (
            f"adapter was trained for {config.base_model_name_or_path!r}, not the served {spec.name!r}, "
            "and its shapes do not fit: "
        )
    seen: set[tuple[int, str, str]] = set()
    for name, key in keys.items():
        if key.layer >= spec.num_layers:
            raise AdapterRejectedError(
                f"{mismatch_hint}tensor {name!r} is for layer {key.layer}, but the model has {spec.num_layers} layers"
            )
        if not config.targets(key.path):
            raise AdapterRejectedError(f"tensor {name!r} adapts {key.module}, which target_modules does not list")
        want = expected_shape(spec, key, config.rank_for(key.path))
        got = entries[name].shape
        if got != want:
            raise AdapterRejectedError(
                f"{mismatch_hint}layer {key.layer} {key.module} lora_{key.which} has shape {list(got)}, "
                f"expected {list(want)}"
            )
        seen.add((key.layer, key.module, key.which))
    layers = config.layers_to_transform or tuple(range(spec.num_layers))
    for layer in layers:
        for module in config.target_module_names(layer):
            for which in ("A", "B"):
                if (layer, module, which) not in seen:
                    raise AdapterRejectedError(f"layer {layer} {module} lora_{which} is missing")
