"""A batch's lines name few models: each is looked up once every few seconds, and a refusal is never kept."""

from __future__ import annotations

import pytest
from loraplex.platform.batches.line_models import LineModels
from loraplex.platform.errors import NotFoundError
from loraplex.platform.extensions import BaseModelResolver, ServedModel


class CountingResolver(BaseModelResolver):
    """The base-model resolver, counting the lookups that reach it."""

    def __init__(self, base_model_name: str) -> None:
        super().__init__(base_model_name)
        self.lookups: list[tuple[str, str]] = []

    async def resolve(self, tenant_id: str, model: str) -> ServedModel:
        self.lookups.append((tenant_id, model))
        return await super().resolve(tenant_id, model)


async def test_a_model_is_looked_up_once_while_its_entry_is_fresh() -> None:
    resolver = CountingResolver("base")
    models = LineModels(resolver, "acme", max_age_s=60)
    served = [await models.resolve("base") for _ in range(100)]
    assert {s.id for s in served} == {"base"}
    assert resolver.lookups == [("acme", "base")]


async def test_an_old_entry_is_looked_up_again() -> None:
    resolver = CountingResolver("base")
    models = LineModels(resolver, "acme", max_age_s=0)
    await models.resolve("base")
    await models.resolve("base")
    assert resolver.lookups == [("acme", "base"), ("acme", "base")]


async def test_a_refused_model_is_asked_again_by_each_line() -> None:
    resolver = CountingResolver("base")
    models = LineModels(resolver, "acme", max_age_s=60)
    for _ in range(3):
        with pytest.raises(NotFoundError) as refused:
            await models.resolve("gone-adapter")
        assert refused.value.code == "model_not_found"
    assert resolver.lookups == [("acme", "gone-adapter")] * 3
