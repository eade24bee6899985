"""What an adapter must fit: the served model's layer count and each projection's shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    """The served model as adapters see it; built from its Hugging Face config.json."""

    name: str
    num_layers: int
    # module name -> (in_features, out_features)
    module_shapes: dict[str, tuple[int, int]]
    # names a PEFT config's base_model_name_or_path may carry for this model (lower-cased)
    aliases: frozenset[str] = frozenset()

    @classmethod
    def from_hf_config(cls, config: dict, *, name: str, aliases: tuple[str, ...] = ()) -> BaseModelSpec:
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        inter = config["intermediate_size"]
        shapes = {
            "q_proj": (hidden, heads * head_dim),
            "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim),
            "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        names = {name.lower(), *(a.lower() for a in aliases)}
        return cls(name, config["num_hidden_layers"], shapes, frozenset(names))

    @classmethod
    def from_model_dir(cls, model_dir: Path, *, name: str | None = None) -> BaseModelSpec:
        config = json.loads((model_dir / "config.json").read_text())
        served = name or model_dir.name
        return cls.from_hf_config(config, name=served, aliases=(model_dir.name, str(model_dir)))

    @classmethod
    def from_model_config(cls, config: object, *, name: str, aliases: tuple[str, ...] = ()) -> BaseModelSpec:
        """From the engine's ModelConfig (any object with the Hugging Face field names)."""
        fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_hidden_layers")
        return cls.from_hf_config({f: getattr(config, f) for f in fields}, name=name, aliases=aliases)

    def to_dict(self) -> dict:
        """Message-safe form (the validation task receives it inside its job)."""
        return {"name": self.name, "num_layers": self.num_layers,
                "module_shapes": {m: list(s) for m, s in self.module_shapes.items()}, "aliases": sorted(self.aliases)}

    @classmethod
    def from_dict(cls, data: dict) -> BaseModelSpec:
        shapes = {m: (int(s[0]), int(s[1])) for m, s in data["module_shapes"].items()}
        return cls(data["name"], int(data["num_layers"]), shapes, frozenset(data["aliases"]))

    def matches_name(self, base_model_name_or_path: str) -> bool:
        """PEFT writes whatever path the trainer loaded from; match its last component too."""
        candidate = base_model_name_or_path.strip().rstrip("/").lower()
        last = candidate.rsplit("/", 1)[-1]
        return candidate in self.aliases or last in {a.rsplit("/", 1)[-1] for a in self.aliases}
