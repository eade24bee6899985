"""What one running API process holds (stored on `app.state.services`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.core.client import EngineClient
from loraplex.platform.api.logprobs import TokenTexts
from loraplex.platform.api.request_limits import RequestLimits
from loraplex.platform.auth.key_cache import KeyCache
from loraplex.platform.extensions import Extensions
from loraplex.platform.metrics import Metrics
from loraplex.platform.pipeline import RequestPipeline
from loraplex.platform.ratelimit.limiter import RateLimiter
from loraplex.platform.settings import Settings
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker


@dataclass(slots=True)
class Services:
    settings: Settings
    db_engine: Engine
    db_sessions: sessionmaker[Session]
    rate_limiter: RateLimiter
    engine: EngineClient             # in-process (AsyncEngine) or the engine-core process
    tokenizer: Any                   # the engine's Hugging Face tokenizer
    token_texts: TokenTexts          # cached single-token decoding for logprobs
    base_model_name: str
    extensions: Extensions
    pipeline: RequestPipeline        # the declared stages, built once from extensions.stages
    metrics: Metrics
    key_cache: KeyCache[Any]         # authenticated keys (deps.Principal) by key hash
    request_limits: RequestLimits    # the settings' counted limits, built once (checked on every request)
    owns_engine: bool = True         # False when a test passed its own engine in
    num_inflight: int = field(default=0)        # requests (prompts) admitted and not yet finished
    inflight_by_tenant: dict[str, int] = field(default_factory=dict)
    draining: bool = False                      # SIGTERM received: finishing in-flight requests, taking no new ones
