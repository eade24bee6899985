"""Prometheus metrics for one app (its own registry, so several apps can live in one test process).

With several API server processes (`loraplex serve --api-servers N`) the
request metrics of all of them are aggregated through prometheus_client's
multiprocess mode: the supervisor gives every API server one shared
directory (PROMETHEUS_MULTIPROC_DIR for the library, `multiprocess_dir`
here), each process writes its counters there, and a scrape of any of them
reads all. The engine's and sessions' gauges come from the engine core's
own counters, which every API server sees alike, so they are rendered from
the scraped process only. The same numbers also appear under vLLM's names
(platform/metrics_vllm.py), for gateways and dashboards made for vLLM.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from typing import Any

from loraplex.platform.metrics_vllm import with_aliases
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# engine.stats() key -> (metric name, help). Read at scrape time, so the gauges are never stale.
ENGINE_GAUGES = {
    "num_waiting": ("loraplex_engine_queue_depth", "Sequences waiting for admission into the batch"),
    "num_running": ("loraplex_engine_running_requests", "Sequences in the running batch"),
    "num_blocks_used": ("loraplex_kv_blocks_used", "KV-cache blocks in use"),
    "num_blocks_free": ("loraplex_kv_blocks_free", "KV-cache blocks free"),
    "num_blocks_pinned": ("loraplex_kv_blocks_pinned", "KV-cache blocks pinned by sessions"),
    "num_preemptions": ("loraplex_engine_preemptions", "Sequences preempted (recomputed) since start"),
}


class Metrics:
    def __init__(self, multiprocess_dir: str | None = None, *, model_name: str = "") -> None:
        self.multiprocess_dir = multiprocess_dir
        self.model_name = model_name  # the `model_name` label of the vLLM-named series
        self._collectors: list[Collector] = []  # read at scrape time from this process (engine, sessions)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraplex_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "loraplex_time_to_first_token_seconds", "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "loraplex_inter_token_latency_seconds", "Time between consecutive outputs of a request",
            buckets=_INTER_TOKEN_BUCKETS, registry=self.registry,
        )
        self.request_duration = Histogram(
            "loraplex_request_duration_seconds", "Arrival to last output of a request that generated",
            buckets=_REQUEST_BUCKETS, registry=self.registry,
        )
        self.session_turns_moved = Counter(
            "loraplex_session_turns_moved", "Session turns and Responses continuations served by another replica "
            "than the one holding their KV (prefilled again from the transcript)", registry=self.registry,
        )
        self.tokens_in = Counter("loraplex_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.tokens_cached = Counter("loraplex_cached_prompt_tokens", "Prompt tokens from cache", registry=self.registry)
        self.tokens_out = Counter("loraplex_completion_tokens", "Tokens generated", registry=self.registry)
        self.tokens_reasoning = Counter(
            "loraplex_reasoning_tokens", "Generated tokens inside a reasoning segment", registry=self.registry
        )
        self._requests_by_label: dict[tuple[str, int], Any] = {}
        self.inflight = Gauge("loraplex_api_inflight_requests", "Generation requests in the API",
                              registry=self.registry, multiprocess_mode="livesum")

    def count_response(self, route: str, status: int) -> None:
        """One HTTP response, by its route template (bounded labels) and status (counted by the edge)."""
        child = self._requests_by_label.get((route, status))
        if child is None:  # labels() takes a lock and builds the label tuple: done once per pair
            child = self._requests_by_label[(route, status)] = self.requests.labels(route=route, status=str(status))
        child.inc()

    def register_collector(self, collector: Collector) -> None:
        self._collectors.append(collector)
        self.registry.register(collector)

    def watch_engine(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.register_collector(_EngineCollector(stats))

    def render(self) -> bytes:
        """The exposition text (reads engine stats and, with several API servers, their files: not on the loop)."""
        registry = self.registry
        if self.multiprocess_dir is not None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
            for collector in self._collectors:
                registry.register(collector)
        return generate_latest(_Aliased(registry, self.model_name))


class _Aliased:
    """What generate_latest reads: the registry's families, plus vLLM's names for our histograms."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Any]:
        return with_aliases(self._registry.collect(), self._model_name)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        for key, (name, help_text) in ENGINE_GAUGES.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                yield GaugeMetricFamily(name, help_text, value=float(value))
        queries = stats.get("prefix_cache_queries") or 0
        hits = stats.get("prefix_cache_hits") or 0
        yield GaugeMetricFamily(
            "loraplex_prefix_cache_hit_rate", "Prefix-cache block hits / lookups since start",
            value=hits / queries if queries else 0.0,
        )


class TokenTimer:
    """TTFT and inter-token latency of one request, observed as its outputs arrive.

    The gaps between outputs are kept here and added to the histogram once, when the request ends
    (`flush`): observing a histogram takes a lock and, with several API servers, writes two memory-mapped
    values, which per streamed output of every stream is a share of the step time worth saving.
    """

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None
        self._gaps: list[float] = []
        self.time_to_first_token_s: float | None = None
        self._ended = False

    def on_output(self, received_at: float | None = None) -> None:
        """An output read; `received_at`: when its first token reached this process, where outputs were held
        back and merged (a non-streaming request's time to first token is still its first token's)."""
        now = time.monotonic()
        if self._last is None:
            self.time_to_first_token_s = (received_at if received_at is not None else now) - self._arrival
            self._metrics.time_to_first_token.observe(self.time_to_first_token_s)
        else:
            self._gaps.append(now - self._last)
        self._last = now

    def flush(self) -> None:
        """The request ended: its gaps, and its whole duration if it generated anything."""
        gaps, self._gaps = self._gaps, []
        if gaps:
            observe_many(self._metrics.inter_token_latency, gaps)
        if self._last is not None and not self._ended:
            self._ended = True
            self._metrics.request_duration.observe(self._last - self._arrival)


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe` for each value, with one write per bucket touched instead of two per value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client layout: one by one
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value, as observe() picks it
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)
    total.inc(sum(values))
