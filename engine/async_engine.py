"""AsyncEngine: the engine core in a thread of this process; the in-process `EngineClient`.

It is the one client front end (`engine/core/frontend.py`) over the in-process
transport (`engine/core/local_transport.py`): the same command loop as the
engine-core process, the same generate / abort / stop strings / adapter
changes; only the messages cross as objects instead of over a socket. Input is
validated before anything is queued, so bad input raises at once and never hangs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.engine.core.frontend import EngineFrontend
from loraplex.engine.core.local_transport import LocalClientTransport
from loraplex.engine.llm_engine import LLMEngine


class AsyncEngine(EngineFrontend):
    def __init__(self, engine: LLMEngine, num_threads: int | None = None) -> None:
        """`engine` built with detokenize=False: each caller's loop makes its own text (OutputStream)."""
        self._local = LocalClientTransport(engine, num_threads)
        super().__init__(self._local, tokenizer=engine.tokenizer, model_config=engine.model_config,
                         max_model_len=engine.max_model_len)
        self.engine = engine

    @classmethod
    def from_model_path(cls, path: str | Path, config: EngineConfig | None = None, **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine.from_model_path(path, config or EngineConfig(), detokenize=False, **kwargs))

    @classmethod
    def from_random(
        cls, model_config: ModelConfig, config: EngineConfig, tokenizer: Any, seed: int = 0, **kwargs: Any
    ) -> AsyncEngine:
        return cls(LLMEngine.from_random(model_config, config, tokenizer, seed, detokenize=False, **kwargs))

    @property
    def is_alive(self) -> bool:
        return self._local.is_alive
