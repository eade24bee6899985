"""The model-server protocol: our engine's numbers under vLLM's metric names, beside the `loraplex_*` ones.

Gateways that pick a replica from Prometheus metrics (Kubernetes' Gateway API
Inference Extension with llm-d's endpoint picker, vLLM's production-stack
router) and vLLM's Grafana dashboards read these names:

- gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (a fraction, as vLLM's is) and its older name
  `vllm:gpu_cache_usage_perc`;
- `vllm:cache_config_info{block_size,num_gpu_blocks,...}` (value 1);
- `vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}`,
  whose value is the scrape's time (readers take the newest series); the
  adapters are comma-separated as requests name them in `model`;
- counters `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
  `vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` (speculative decoding) and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}` (accepted drafts
  at each draft position, 0 the first, as vLLM labels them);
- histograms `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`: our own histograms (platform/metrics.py,
  summed over every API server) under a second name.

All carry `model_name`, the served base model (an adapter's requests count
under it, as vLLM counts LoRA requests under the base model). The gauges and
counters come from the engine core's own counters (its `Stats` messages),
which every API server of a replica sees alike, so each scrape renders them
once, from the scraped process; several API servers cannot double them.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from loraplex.platform.errors import AuthenticationError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

# Our histogram -> the vLLM name it is also shown under.
HISTOGRAM_ALIASES = {
    "loraplex_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "loraplex_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "loraplex_request_duration_seconds": "vllm:e2e_request_latency_seconds",
}

# engine.stats() key -> (vLLM counter name without `_total`, help)
ENGINE_COUNTERS = {
    "prompt_tokens_total": ("vllm:prompt_tokens", "Prefill tokens processed (cached ones included)"),
    "generation_tokens_total": ("vllm:generation_tokens", "Generation tokens produced"),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemptions"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "spec_decode_num_draft_tokens_total": ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified"),
    "spec_decode_num_accepted_tokens_total": ("vllm:spec_decode_num_accepted_tokens",
                                              "Draft tokens the output kept"),
}


class AdapterNames:
    """Adapter id -> the name requests use for it, remembered (an id's name never changes).

    `find(adapter_id)` returns the adapter's record (with `.name`) or None; an adapter that is gone
    is shown by its id. Lookups may touch the database: call off the event loop.
    """

    def __init__(self, find: Callable[[str], Any], max_entries: int = 10_000) -> None:
        self._find = find
        self._names: OrderedDict[str, str] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def __call__(self, adapter_id: str) -> str:
        with self._lock:
            name = self._names.get(adapter_id)
        if name is not None:
            return name
        try:
            record = self._find(adapter_id)
        except Exception:
            log.exception("could not look up adapter %s", adapter_id)
            return adapter_id
        if record is None:
            return adapter_id
        with self._lock:
            self._names[adapter_id] = record.name
            while len(self._names) > self._max_entries:
                self._names.popitem(last=False)
        return record.name

    def names(self, adapter_ids: Iterable[str]) -> str:
        return ",".join(sorted({self(a) for a in adapter_ids}))


class VllmEngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], *, model_name: str, block_size: int, max_loras: int,
                 enable_prefix_caching: bool, adapter_names: AdapterNames | None) -> None:
        self._stats = stats
        self._model = model_name
        self._block_size = block_size
        self._max_loras = max_loras
        self._prefix_caching = enable_prefix_caching
        self._names = adapter_names

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        model = [self._model]
        running = _gauge("vllm:num_requests_running", "Requests in the running batch")
        running.add_metric(model, float(stats.get("num_running", 0)))
        waiting = _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        waiting.add_metric(model, float(stats.get("num_waiting", 0)))
        yield from (running, waiting)
        total = stats.get("num_blocks_total") or 0
        usage = (stats.get("num_blocks_used") or 0) / total if total else 0.0
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            family = _gauge(name, "KV-cache usage: 1 means 100 percent")
            family.add_metric(model, usage)
            yield family
        config = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration",
                                   labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "model_name"])
        config.add_metric([str(self._block_size), str(int(total)), str(self._prefix_caching), self._model], 1.0)
        yield config
        yield self._lora_info(stats)
        for key, (name, help_text) in ENGINE_COUNTERS.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                counter = CounterMetricFamily(name, help_text, labels=["model_name"])
                counter.add_metric(model, float(value))
                yield counter
        yield from self._accepted_per_position(stats)
        yield from self._labelled_counter(stats.get("engine_steps"), "loraplex_engine_steps",
                                          "Engine steps run, by how they ran", "kind")
        yield from self._labelled_counter(stats.get("overlap_steps"), "loraplex_engine_overlap_steps",
                                          "Overlapped scheduling: engine steps by how they ran (ahead, launched, "
                                          "not_launchable, launch_failed) and the host's waits for the step in "
                                          "flight by why (not_plain, room, drafts)", "outcome")
        yield from self._step_gpu_time(stats.get("engine_step_gpu"))

    def _labelled_counter(self, counts: dict[str, int] | None, name: str, help_text: str, label: str
                          ) -> Iterator[Metric]:
        """A counter family with one series per key of `counts` (none while it is empty): `loraplex_engine_steps
        {kind}` (CUDA: `decode_graph`, `mixed_graph`, `eager`: eager steps cost the host's kernel launches, so
        a rising share of them explains slow steps) and, with overlapped scheduling on,
        `loraplex_engine_overlap_steps{outcome}` (engine/step_overlap.py: a share of `ahead` falling explains
        steps the host no longer hides)."""
        if not counts:
            return
        counter = CounterMetricFamily(name, help_text, labels=["model_name", label])
        for key, count in sorted(counts.items()):
            counter.add_metric([self._model, key], float(count))
        yield counter

    def _step_gpu_time(self, totals: dict[str, list[float]] | None) -> Iterator[Metric]:
        """`loraplex_engine_step_gpu_seconds_total{kind,rows}` and `loraplex_engine_timed_steps_total{kind,rows}`
        (CUDA, engine/cuda/step_timer.py): the GPU time of the steps' forward passes by how they ran and their
        padded rows; one over the other is what a step of that shape costs the GPU (a mixed step admitting prompts
        beside a decode step of the same rows prices batch work beside interactive traffic)."""
        if not totals:
            return
        seconds = CounterMetricFamily("loraplex_engine_step_gpu_seconds",
                                      "GPU seconds of the engine steps' forward passes, by how they ran and their "
                                      "padded rows", labels=["model_name", "kind", "rows"])
        steps = CounterMetricFamily("loraplex_engine_timed_steps", "Engine steps whose forward pass was timed on "
                                    "the GPU, by how they ran and their padded rows",
                                    labels=["model_name", "kind", "rows"])
        for key, (count, total) in sorted(totals.items()):
            kind, _, rows = key.partition(":")
            seconds.add_metric([self._model, kind, rows], float(total))
            steps.add_metric([self._model, kind, rows], float(count))
        yield seconds
        yield steps

    def _accepted_per_position(self, stats: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's per-position acceptance counter; absent while speculation is off (no positions)."""
        counts = stats.get("spec_decode_num_accepted_tokens_per_pos") or []
        if not counts:
            return
        counter = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens the output kept, per draft position (0: the first)",
                                      labels=["model_name", "position"])
        for position, count in enumerate(counts):
            counter.add_metric([self._model, str(position)], float(count))
        yield counter

    def _lora_info(self, stats: dict[str, Any]) -> GaugeMetricFamily:
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                   labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", "model_name"])
        running = stats.get("running_adapter_ids") or []
        waiting = stats.get("waiting_adapter_ids") or []
        names = self._names
        family.add_metric([str(self._max_loras), names.names(running) if names else ",".join(sorted(running)),
                           names.names(waiting) if names else ",".join(sorted(waiting)), self._model], time.time())
        return family


def _gauge(name: str, help_text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, labels=["model_name"])


def with_aliases(families: Iterable[Metric], model_name: str) -> Iterator[Metric]:
    """Every family as it is, then each aliased histogram again under its vLLM name with `model_name`."""
    for family in families:
        yield family
        alias = HISTOGRAM_ALIASES.get(family.name)
        if alias is None:
            continue
        copy = Metric(alias, family.documentation, family.type)
        for sample in family.samples:
            copy.samples.append(Sample(alias + sample.name[len(family.name):], {**sample.labels, "model_name": model_name},
                                       sample.value, sample.timestamp, sample.exemplar))
        yield copy


def install_vllm_metrics(metrics: Any, settings: Any, stats: Callable[[], dict[str, Any]], *, base_model_name: str,
                         extensions: Any) -> None:
    """Show the engine under vLLM's names on `metrics` (platform/metrics.Metrics), adapters by their names."""
    metrics.model_name = base_model_name
    adapters = extensions.domain_state.get("adapters")
    names = AdapterNames(adapters.service.registry.find) if adapters is not None else None
    metrics.register_collector(VllmEngineCollector(
        stats, model_name=base_model_name, block_size=settings.kv_block_size, max_loras=settings.max_loras,
        enable_prefix_caching=settings.enable_prefix_caching, adapter_names=names,
    ))


def check_metrics_token(authorization: str | None, token: str | None) -> None:
    """GET /metrics with `metrics_bearer_token` set: the token or a 401 (compared in constant time)."""
    if token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise AuthenticationError("GET /metrics needs the metrics token: Authorization: Bearer <token>",
                                  code="invalid_metrics_token")
