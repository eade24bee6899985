"""Builds what one API process runs on: database, rate limiter, engine, and every domain's extensions.

This is the one place that knows all domains. Adapters, grammar, sessions
and billing register here (see `build_extensions`); their code never
imports the platform. Where each request stage runs is declared in
pipeline.STAGE_ORDER, not by the order of the lines below.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from loraplex.engine.core.client import EngineClient
from loraplex.platform.api.logprobs import TokenTexts
from loraplex.platform.api.request_limits import RequestLimits
from loraplex.platform.auth.revocation import build_key_cache
from loraplex.platform.db import migrate
from loraplex.platform.db.session import make_db_engine, make_session_factory
from loraplex.platform.extensions import BaseModelResolver, Extensions
from loraplex.platform.metering import install_billing
from loraplex.platform.metrics import Metrics
from loraplex.platform.metrics_vllm import install_vllm_metrics
from loraplex.platform.pipeline import RequestPipeline
from loraplex.platform.ratelimit.limiter import make_rate_limiter
from loraplex.platform.reasoning import install_reasoning
from loraplex.platform.responses.chain import install_responses
from loraplex.platform.routers.adapters import install_adapters
from loraplex.platform.services import Services
from loraplex.platform.sessions_domain import install_sessions
from loraplex.platform.settings import Settings
from loraplex.platform.structured import install_structured_output
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)


def engine_config(settings: Settings) -> Any:
    from loraplex.engine.config import EngineConfig

    return EngineConfig(
        block_size=settings.kv_block_size,
        kv_cache_bytes=settings.kv_cache_memory_mb * 1024 * 1024,
        num_blocks=settings.num_kv_blocks,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        dtype=settings.resolve_dtype(),
        device=settings.resolve_device(),
        enable_prefix_caching=settings.enable_prefix_caching,
        host_kv_bytes=settings.kv_host_memory_mb * 1024 * 1024,
        max_pinned_blocks=settings.max_pinned_blocks,
        max_pinned_blocks_per_tenant=settings.resolve_max_pinned_blocks_per_tenant(),
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        cuda_graph_mixed_steps=settings.cuda_graph_mixed_steps,
        overlap_scheduling=settings.overlap_scheduling,
        decode_yield_min_tokens=settings.decode_yield_min_tokens,
        fair_sharing=settings.fair_sharing,
        newcomer_reserved_slots=settings.newcomer_reserved_slots,
        flood_sit_out_prompt_tokens=settings.flood_sit_out_prompt_tokens,
        batch_rows_beside_interactive=settings.batch_rows_beside_interactive,
        batch_admission_wave=settings.batch_admission_wave,
        batch_prefill_tokens_beside_interactive=settings.batch_prefill_tokens_beside_interactive,
        speculative_decoding=settings.speculative_decoding,
        speculative_num_tokens=settings.speculative_num_tokens,
        speculative_ngram_min=settings.speculative_ngram_min,
        speculative_ngram_max=settings.speculative_ngram_max,
    )


def build_engine(settings: Settings) -> EngineClient:
    """The engine-core process's client when `serve` started one, else the in-process engine for the
    configured model (converting the bundled GGUF on first use)."""
    if settings.engine_core_address is not None:
        from loraplex.platform.engine_process import connect_engine

        return connect_engine(settings, settings.engine_core_address)
    from loraplex.engine.async_engine import AsyncEngine

    model_path = settings.resolve_model_path()
    log.info("loading model %s", model_path)
    return AsyncEngine.from_model_path(model_path, engine_config(settings))


def served_model_name(settings: Settings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model_path is not None:
        return settings.model_path.name
    from loraplex.engine.model.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def build_extensions(
    settings: Settings, *, base_model_name: str, engine: EngineClient,
    db_sessions: sessionmaker[Session] | None = None, metrics: Metrics | None = None,
) -> Extensions:
    """Every domain's hooks; each domain's install function is its one place of wiring:

    - adapters:  `extensions.model_resolver` (a resolver that knows the tenant's adapters)
    - sessions:  stage `session`; the sweeper's stop in `on_shutdown`
    - billing:   stage `quota` (budget spent: 429), an admission check (this prompt would overrun it),
                 the meter as a usage recorder
    - reasoning: stage `reasoning`; grammar: stage `structured_output`
    """
    extensions = Extensions(model_resolver=BaseModelResolver(base_model_name))
    install_sessions(extensions, settings, engine=engine, metrics=metrics)
    install_responses(extensions, settings, engine=engine)
    if db_sessions is not None:
        install_adapters(extensions, settings, engine=engine, db_sessions=db_sessions, base_model_name=base_model_name)
    if settings.metering_enabled and db_sessions is not None:
        install_billing(extensions, settings, db_sessions=db_sessions, base_model=base_model_name)
    install_reasoning(extensions, settings, engine=engine)
    install_structured_output(extensions, settings, engine=engine)
    return extensions


def build_services(settings: Settings, engine: EngineClient | None = None, *, metrics: Metrics | None = None) -> Services:
    if settings.gil_switch_interval_ms is not None:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    migrate.prepare_database(settings)
    owns_engine = engine is None
    if engine is None:
        engine = build_engine(settings)
    db_engine = make_db_engine(settings.resolved_database_url)
    db_sessions = make_session_factory(db_engine)
    base_model_name = served_model_name(settings)
    metrics = metrics or Metrics()
    metrics.watch_engine(engine.stats)
    extensions = build_extensions(
        settings, base_model_name=base_model_name, engine=engine, db_sessions=db_sessions, metrics=metrics
    )
    install_vllm_metrics(metrics, settings, engine.stats, base_model_name=base_model_name, extensions=extensions)
    return Services(
        settings=settings,
        db_engine=db_engine,
        db_sessions=db_sessions,
        rate_limiter=make_rate_limiter(settings.redis_url, prefix=settings.redis_key_prefix),
        engine=engine,
        tokenizer=engine.tokenizer,
        token_texts=TokenTexts(engine.tokenizer),
        base_model_name=base_model_name,
        extensions=extensions,
        pipeline=RequestPipeline(extensions.stages),
        metrics=metrics,
        key_cache=build_key_cache(settings, extensions.on_shutdown),
        request_limits=RequestLimits.from_settings(settings),
        owns_engine=owns_engine,
    )


async def close_services(services: Services) -> None:
    for closer in services.extensions.on_shutdown:
        try:
            await closer()
        except Exception:
            log.exception("shutdown hook failed")
    await services.rate_limiter.close()
    if services.owns_engine:
        services.engine.shutdown()
    services.db_engine.dispose()
