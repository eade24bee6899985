"""A tenant's share of grammar compilation: its slow schemas hold at most its own slots, a request queued behind
them gets a 429 by a deadline, and other tenants (and its own cached schemas) compile at once meanwhile."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.compiler import GrammarCompilerService, GrammarLimits
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.platform.api.compile_slots import TenantCompileLimitError, TenantCompileSlots
from loraplex.platform.errors import status_for
from transformers import AutoTokenizer
from waiting import async_wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 49152
# ~2 s of xgrammar compilation on an idle 2-core CPU; killed at the 1.5 s limit below
SLOW = GrammarSpec(GrammarKind.REGEX, "[a-z0-9]{1,5000}[0-9a-f]{1,5000}", param="response_format.regex")


@pytest.fixture(scope="module")
def tokenizer():
    from loraplex.engine.model.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model(REPO_ROOT / "data" / "models"))


async def test_one_tenants_slow_compilations_never_hold_another_tenants(tokenizer):
    service = GrammarCompilerService(tokenizer, VOCAB, GrammarLimits(compile_timeout_s=1.5))
    slots = TenantCompileSlots(max_per_tenant=1, wait_s=0.3)

    async def compile_as(tenant: str, spec: GrammarSpec):
        async with slots.hold(tenant, spec):
            return await service.compile(spec)

    try:
        cached = GrammarSpec(GrammarKind.REGEX, "[a-z]+")
        await compile_as("attacker", cached)  # the worker is up, and this spec is compiled
        slow = asyncio.create_task(compile_as("attacker", SLOW))
        await async_wait_until(lambda: slots.num_in_flight("attacker") == 1, timeout_s=10,
                               what="the slow compilation to take the tenant's slot")

        start = time.monotonic()
        with pytest.raises(TenantCompileLimitError) as info:
            await compile_as("attacker", GrammarSpec(GrammarKind.REGEX, "[0-9]{2,5}"))
        # queued behind its own slot for the whole wait, refused by the deadline while the slot is still held
        assert time.monotonic() - start > 0.25
        assert not slow.done()
        assert status_for(info.value) == 429 and info.value.code == "tenant_compile_limit"
        assert "grammar_compiles_per_tenant" in str(info.value) and info.value.headers()["Retry-After"] == "1"

        await asyncio.wait_for(compile_as("attacker", cached), 1.0)  # a cached schema needs no slot
        # Another tenant compiles at once (a JSON schema: llguidance, in this process's second compile thread).
        grammar = await compile_as("victim", GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "integer"}))
        assert not slow.done()
        assert grammar.new_matcher().accept_token(tokenizer.encode("4", add_special_tokens=False)[0])

        # Under `auto` a regex may compile in llguidance (bounded by its fuel, not stopped at the wall-clock
        # limit) or in xgrammar's worker (killed at the limit): either way it ends, and its slot returns.
        try:
            await slow
        except InvalidRequestError as exc:
            assert "longer than" in str(exc)
        assert slots.num_in_flight("attacker") == 0
        await asyncio.wait_for(compile_as("attacker", GrammarSpec(GrammarKind.REGEX, "[0-9]{2,5}")), 10.0)
    finally:
        service.close()


async def test_zero_turns_the_cap_off():
    slots = TenantCompileSlots(max_per_tenant=0, wait_s=0.0)
    spec = GrammarSpec(GrammarKind.REGEX, "[a-z]")
    async with slots.hold("t", spec), slots.hold("t", spec):
        assert slots.num_in_flight("t") == 0


