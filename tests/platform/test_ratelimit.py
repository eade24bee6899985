"""Both rate-limiter backends keep the same contract; the Redis one is atomic under concurrency."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from loraplex.platform.errors import RateLimitedError
from loraplex.platform.ratelimit.limiter import InProcessRateLimiter, Limits, RateLimiter, RedisRateLimiter


@pytest.fixture(params=["memory", "redis"])
def limiter(request: pytest.FixtureRequest, redis_url: str, redis_prefix: str) -> RateLimiter:
    if request.param == "memory":
        return InProcessRateLimiter()
    return RedisRateLimiter(redis_url, prefix=redis_prefix)


async def test_requests_per_minute(limiter: RateLimiter) -> None:
    key = "key_" + secrets.token_hex(4)
    limits = Limits(rpm=2, tpm=0)
    await limiter.admit(key, limits, num_prompt_tokens=10)
    await limiter.admit(key, limits, num_prompt_tokens=10)
    with pytest.raises(RateLimitedError) as raised:
        await limiter.admit(key, limits, num_prompt_tokens=10)
    assert raised.value.code == "rate_limit_exceeded"
    assert 60 >= raised.value.retry_after_s >= 1
    await limiter.admit("key_other", limits, num_prompt_tokens=10)  # limits are per key
    await limiter.close()


async def test_tokens_per_minute_counts_prompt_and_completion(limiter: RateLimiter) -> None:
    key = "key_" + secrets.token_hex(4)
    limits = Limits(rpm=0, tpm=100)
    await limiter.admit(key, limits, num_prompt_tokens=40)
    await limiter.add_tokens(key, limits, 50)
    with pytest.raises(RateLimitedError) as raised:
        await limiter.admit(key, limits, num_prompt_tokens=11)  # 90 + 11 > 100
    assert raised.value.code == "tokens_rate_limit_exceeded"
    await limiter.admit(key, limits, num_prompt_tokens=10)  # a refused request charged nothing
    await limiter.close()


async def test_unlimited_when_zero(limiter: RateLimiter) -> None:
    key = "key_" + secrets.token_hex(4)
    for _ in range(50):
        await limiter.admit(key, Limits(rpm=0, tpm=0), num_prompt_tokens=1000)
    await limiter.close()


async def test_redis_admission_is_atomic(redis_url: str, redis_prefix: str) -> None:
    """Many clients racing for the same key: exactly `rpm` get in, whatever the interleaving."""
    limiters = [RedisRateLimiter(redis_url, prefix=redis_prefix) for _ in range(4)]
    key = "key_" + secrets.token_hex(4)
    limits = Limits(rpm=10, tpm=0)

    async def attempt(i: int) -> bool:
        try:
            await limiters[i % 4].admit(key, limits, num_prompt_tokens=1)
            return True
        except RateLimitedError:
            return False

    results = await asyncio.gather(*(attempt(i) for i in range(60)))
    assert sum(results) == 10
    for limiter in limiters:
        await limiter.close()
