"""The models a batch's lines name, each looked up once every few seconds instead of once a line.

An online request resolves its `model` on its own (an adapter is a registry
row: a database query and a thread hop). A batch's thousands of lines name a
handful of models, and on an H200 serving SmolLM2 those lookups were a fifth
of the batch worker's time, which bounds how fast lines reach the engine. A
model is resolved again once its entry is `max_age_s` old, so an adapter
deleted or replaced during a batch is seen within that time; a refusal (an
unknown model) is never kept, each line asks again and gets the same error.
"""

from __future__ import annotations

import time

from loraplex.platform.extensions import ModelResolver, ServedModel

MAX_AGE_S = 5.0


class LineModels:
    def __init__(self, resolver: ModelResolver, tenant_id: str, *, max_age_s: float = MAX_AGE_S) -> None:
        self._resolver = resolver
        self._tenant_id = tenant_id
        self._max_age_s = max_age_s
        self._resolved: dict[str, tuple[ServedModel, float]] = {}

    async def resolve(self, model: str) -> ServedModel:
        hit = self._resolved.get(model)
        now = time.monotonic()
        if hit is not None and now - hit[1] < self._max_age_s:
            return hit[0]
        served = await self._resolver.resolve(self._tenant_id, model)
        self._resolved[model] = (served, now)
        return served
