"""A failed adapter load is retried when the failure may pass, and kept when reading again cannot help.

Transient failures (the folder vanished for a moment) fail the requests that
hit them, then expire after a per-adapter backoff that doubles; permanent ones
(the files do not fit the model) are never re-read until the files move.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from engine_helpers import drain, greedy
from loraplex.adapters.base_model import BaseModelSpec
from loraplex.adapters.source import FolderAdapterSource
from loraplex.engine.config import AdapterLimits, EngineConfig, ModelConfig
from loraplex.engine.cuda.random_weights import SyntheticTokenizer
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.lora.host_cache import LoadFailure
from loraplex.engine.lora.manager import LoRAManager
from loraplex.engine.model.loader import random_model
from loraplex.engine.protocol import EngineRequest
from random_adapters import TINY_HF_CONFIG, write_random_adapter
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)

TINY_CONFIG = ModelConfig.from_hf_dict(TINY_HF_CONFIG)
PROMPT = [5, 17, 42, 99, 3, 64, 7, 200]


class LocatingFolderSource(FolderAdapterSource):
    """Folders that also say where an adapter's files are, so a re-upload (new folder) is seen at once."""

    def locate(self, adapter_id: str) -> str | None:
        folder = self.folders.get(adapter_id)
        return None if folder is None else str(folder)


@pytest.fixture(scope="module")
def tiny_model():  # type: ignore[no-untyped-def]
    return random_model(TINY_CONFIG, 128, 0, torch.float32, "cpu")


def failure_of(manager: LoRAManager, adapter_id: str) -> LoadFailure:
    failure = manager.host.failure(adapter_id)
    assert failure is not None
    return failure


def settle(manager: LoRAManager, adapter_id: str) -> bool:
    """Ask for the adapter until it is resident (True) or its load has failed (False)."""
    outcome: list[bool] = []
    wait_until(lambda: outcome.append(manager.adapter_ready(adapter_id)) or outcome[-1] or manager.load_error(adapter_id),
               interval_s=0.005, what=f"adapter {adapter_id} to load or fail")
    return outcome[-1]


def test_vanished_folder_fails_requests_then_serves_after_the_backoff(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    folder = write_random_adapter(tmp_path / "flaky", spec, r=8, targets=("q_proj", "v_proj", "down_proj"), seed=3,
                                  b_scale=1.0)
    reference_copy = shutil.copytree(folder, tmp_path / "reference")
    engine = LLMEngine(tiny_model, TINY_CONFIG, EngineConfig(num_blocks=64, max_num_seqs=8, max_model_len=128),
                       SyntheticTokenizer(TINY_CONFIG.vocab_size))
    source = FolderAdapterSource({"flaky": folder, "reference": reference_copy}, spec, torch.float32)
    manager = engine.serve_adapters(source, AdapterLimits(max_loras=2, max_cpu_loras=4, max_lora_rank=16,
                                                          load_retry_base_s=2.0))
    try:
        engine.add_request(EngineRequest("reference", PROMPT, greedy(8), adapter_id="reference"))
        engine.add_request(EngineRequest("base", PROMPT, greedy(8)))
        reference = drain(engine, timeout_s=60)
        assert reference["reference"].error is None and len(reference["reference"].token_ids) == 8
        assert reference["reference"].token_ids != reference["base"].token_ids  # the adapter changes the output

        away = folder.rename(tmp_path / "flaky-away")  # the storage hiccup: the adapter's folder is gone
        engine.add_request(EngineRequest("during-1", PROMPT, greedy(8), adapter_id="flaky"))
        failed = drain(engine, timeout_s=60)["during-1"]
        assert failed.token_ids == [] and failed.error is not None
        assert "could not be loaded (FileNotFoundError" in failed.error and "will try again" in failed.error
        failure = failure_of(manager, "flaky")
        assert not failure.is_permanent and failure.backoff_s == 2.0
        assert manager.host.num_load_attempts["flaky"] == 1

        # Inside the backoff a request fails at once with the same reason, without touching the disk.
        assert time.monotonic() < failure.retry_at
        engine.add_request(EngineRequest("during-2", PROMPT, greedy(8), adapter_id="flaky"))
        out = engine.step()
        assert [o.request_id for o in out] == ["during-2"] and out[0].error == failed.error
        assert manager.host.num_load_attempts["flaky"] == 1
        assert engine.block_manager.num_free_blocks == engine.num_blocks

        away.rename(folder)  # the storage is back
        # once the backoff expires a new request must wait for the load, not fail
        wait_until(lambda: manager.load_error("flaky") is None, timeout_s=10, what="the backoff to expire")
        assert time.monotonic() >= failure.retry_at
        engine.add_request(EngineRequest("after", PROMPT, greedy(8), adapter_id="flaky"))
        recovered = drain(engine, timeout_s=60)["after"]
        assert recovered.error is None
        assert recovered.token_ids == reference["reference"].token_ids
        assert manager.host.num_load_attempts["flaky"] == 2
        assert manager.host.failure("flaky") is None and manager.load_error("flaky") is None
    finally:
        manager.shutdown()


def other_base_spec() -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(TINY_HF_CONFIG | {"hidden_size": 96, "head_dim": 24}, name="tiny-llama")


@pytest.mark.parametrize(
    ("make_misfit", "expected"),
    [
        # Read fine, but rank 32 does not fit the pool's max_lora_rank 16 (the engine's own check).
        (lambda folder, spec: write_random_adapter(folder, spec, r=32, targets=("q_proj",)),
         "rank 32 > max_lora_rank 16"),
        # Trained for a base model of another width: the reader rejects the tensors' shapes.
        (lambda folder, spec: write_random_adapter(folder, other_base_spec(), r=4, targets=("q_proj",)),
         "cannot be served"),
    ],
    ids=["rank-too-big", "other-base-shapes"],
)
def test_misfit_adapter_is_read_once_until_it_is_reuploaded(tiny_model, tmp_path, spec, make_misfit, expected):  # type: ignore[no-untyped-def]
    source = LocatingFolderSource({"misfit": make_misfit(tmp_path / "misfit", spec)}, spec, torch.float32)
    manager = LoRAManager(tiny_model, source, max_loras=2, max_cpu_loras=2, max_lora_rank=16, dtype=torch.float32,
                          device="cpu", load_retry_base_s=0.01, load_retry_max_s=0.02)
    try:
        assert settle(manager, "misfit") is False
        error = manager.load_error("misfit")
        assert error is not None and expected in error
        assert failure_of(manager, "misfit").is_permanent

        for _ in range(30):  # watched over many times the transient backoff: never retried
            assert manager.adapter_ready("misfit") is False
            assert manager.load_error("misfit") == error
            time.sleep(0.01)
        assert not manager.host.is_loading("misfit")
        assert manager.host.num_load_attempts["misfit"] == 1
        assert manager.resident_adapter_ids == []

        # A re-upload puts fitting files somewhere else: the very next request loads them.
        source.folders["misfit"] = write_random_adapter(tmp_path / "reuploaded", spec, r=8, targets=("q_proj",))
        assert manager.load_error("misfit") is None
        assert settle(manager, "misfit") is True
        assert manager.host.num_load_attempts["misfit"] == 2
        assert manager.resident_adapter_ids == ["misfit"] and manager.host.failure("misfit") is None
    finally:
        manager.shutdown()


def test_backoff_doubles_between_consecutive_transient_failures(tiny_model, tmp_path, spec):  # type: ignore[no-untyped-def]
    folder = tmp_path / "late"  # not written yet: every read fails with FileNotFoundError
    source = FolderAdapterSource({"late": folder}, spec, torch.float32)
    manager = LoRAManager(tiny_model, source, max_loras=1, max_cpu_loras=1, max_lora_rank=16, dtype=torch.float32,
                          device="cpu", load_retry_base_s=0.3, load_retry_max_s=1.2)
    failures: list[LoadFailure] = []
    try:
        assert settle(manager, "late") is False
        for attempt in range(2, 6):
            failure = failure_of(manager, "late")
            failures.append(failure)
            assert failure.num_consecutive == attempt - 1 and "FileNotFoundError" in failure.reason
            assert time.monotonic() < failure.retry_at
            assert manager.adapter_ready("late") is False  # asking again inside the window reads nothing
            assert manager.host.num_load_attempts["late"] == attempt - 1
            wait_until(lambda: manager.load_error("late") is None, timeout_s=5, what="the backoff to run out")
            assert settle(manager, "late") is False
            assert manager.host.num_load_attempts["late"] == attempt
        failures.append(failure_of(manager, "late"))
        assert [f.backoff_s for f in failures] == [0.3, 0.6, 1.2, 1.2, 1.2]  # doubling, capped at the maximum
        failed_at = [f.retry_at - f.backoff_s for f in failures]
        for earlier, later, failure in zip(failed_at, failed_at[1:], failures, strict=False):
            assert later - earlier >= failure.backoff_s  # no read before the window ended

        write_random_adapter(folder, spec, r=4, targets=("v_proj",))
        wait_until(lambda: manager.load_error("late") is None, timeout_s=5, what="the backoff to run out")
        assert settle(manager, "late") is True
        assert manager.host.failure("late") is None  # a successful load resets the backoff
        assert manager.host.num_load_attempts["late"] == 6
    finally:
        manager.shutdown()


def test_a_missing_weights_file_is_storage_trouble_not_a_bad_adapter(tmp_path, spec):  # type: ignore[no-untyped-def]
    """A lost blob raises FileNotFoundError (transient: retried), not a rejection (permanent)."""
    folder = write_random_adapter(tmp_path / "a", spec, r=4, targets=("q_proj",), seed=3)
    source = FolderAdapterSource({"a": folder}, spec, torch.float32)
    assert source.locate("a") == str(folder) and source.locate("nope") is None
    moved = shutil.move(str(folder / "adapter_model.safetensors"), str(tmp_path / "elsewhere.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors of adapter a is missing"):
        source.load("a")
    shutil.move(moved, str(folder / "adapter_model.safetensors"))
    assert source.load("a").adapter_id == "a"
