"""What `/metrics` shows for given engine stats: the families `VllmEngineCollector` renders, by name."""

from __future__ import annotations

from typing import Any

from loraplex.platform.metrics_vllm import VllmEngineCollector
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def scrape(stats: dict[str, Any]) -> dict[str, Any]:
    registry = CollectorRegistry()
    registry.register(VllmEngineCollector(lambda: stats, model_name="smol", block_size=16, max_loras=2,
                                          enable_prefix_caching=True, adapter_names=None))
    return {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}
