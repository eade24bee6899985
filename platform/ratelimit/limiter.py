"""Requests-per-minute and tokens-per-minute per API key, in fixed one-minute windows.

Two backends with one contract: Redis (atomic Lua scripts, so every server
process shares one count) and in-process (a dict, for a single process).
Admission checks and counts in one step; completion tokens are added when
the request ends, so a burst of long answers exhausts the minute's budget.

The API admits in two steps, so a refused request costs nothing expensive:
`admit` with the number of requests (each prompt of a `prompt` list is one)
before templating and tokenizing, then `charge_prompt` once the prompt's
token count is known (refused: the requests counted are given back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from loraplex.platform.errors import RateLimitedError

WINDOW_S = 60


@dataclass(slots=True, frozen=True)
class Limits:
    rpm: int  # 0: unlimited
    tpm: int


class RateLimiter(Protocol):
    async def admit(self, key_id: str, limits: Limits, *, num_prompt_tokens: int, num_requests: int = 1) -> None:
        """Count `num_requests` requests and their prompt tokens, or raise RateLimitedError (counting nothing)."""

    async def charge_prompt(self, key_id: str, limits: Limits, *, num_prompt_tokens: int, num_requests: int) -> None:
        """Count prompt tokens of requests `admit` counted with none; over the limit: RateLimitedError, and
        those requests are uncounted."""

    async def add_tokens(self, key_id: str, limits: Limits, num_tokens: int) -> None:
        """Charge tokens produced after admission."""

    async def close(self) -> None: ...


def _window(now: float) -> tuple[int, int]:
    """(window number, seconds until it ends, at least 1)."""
    window = int(now // WINDOW_S)
    return window, max(1, int((window + 1) * WINDOW_S - now + 0.999))


def _rejection(reason: int, limits: Limits, retry_after_s: int) -> RateLimitedError:
    if reason == 1:
        return RateLimitedError(
            f"rate limit reached: {limits.rpm} requests per minute for this API key",
            retry_after_s=retry_after_s, code="rate_limit_exceeded",
        )
    return RateLimitedError(
        f"rate limit reached: {limits.tpm} tokens per minute for this API key",
        retry_after_s=retry_after_s, code="tokens_rate_limit_exceeded",
    )


class InProcessRateLimiter:
    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], list[int]] = {}  # (key_id, window) -> [requests, tokens]

    async def admit(self, key_id: str, limits: Limits, *, num_prompt_tokens: int, num_requests: int = 1) -> None:
        window, retry_after_s = _window(time.time())
        counts = self._counts.setdefault((key_id, window), [0, 0])
        if limits.rpm and counts[0] + num_requests > limits.rpm:
            raise _rejection(1, limits, retry_after_s)
        if limits.tpm and counts[1] + num_prompt_tokens > limits.tpm:
            raise _rejection(2, limits, retry_after_s)
        counts[0] += num_requests
        counts[1] += num_prompt_tokens
        self._forget_old_windows(window)

    async def charge_prompt(self, key_id: str, limits: Limits, *, num_prompt_tokens: int, num_requests: int) -> None:
        window, retry_after_s = _window(time.time())
        counts = self._counts.setdefault((key_id, window), [0, 0])
        if limits.tpm and counts[1] + num_prompt_tokens > limits.tpm:
            counts[0] = max(0, counts[0] - num_requests)
            raise _rejection(2, limits, retry_after_s)
        counts[1] += num_prompt_tokens

    async def add_tokens(self, key_id: str, limits: Limits, num_tokens: int) -> None:
        window, _ = _window(time.time())
        self._counts.setdefault((key_id, window), [0, 0])[1] += num_tokens

    def _forget_old_windows(self, window: int) -> None:
        if len(self._counts) > 10_000:
            self._counts = {k: v for k, v in self._counts.items() if k[1] >= window}

    async def close(self) -> None:
        self._counts.clear()


# KEYS: requests counter, tokens counter. ARGV: rpm, tpm, prompt tokens, expiry seconds, requests.
# Returns 0 when admitted, 1 when over the request limit, 2 when over the token limit.
_ADMIT_LUA = """
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm, prompt, count = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
if rpm > 0 and requests + count > rpm then return 1 end
if tpm > 0 and tokens + prompt > tpm then return 2 end
redis.call('INCRBY', KEYS[1], count)
redis.call('INCRBY', KEYS[2], prompt)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 0
"""

# The same keys. ARGV: tpm, prompt tokens, expiry seconds, requests to give back when refused.
_CHARGE_PROMPT_LUA = """
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local tpm, prompt = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and tokens + prompt > tpm then
  if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[4]) then redis.call('DECRBY', KEYS[1], ARGV[4]) end
  return 2
end
redis.call('INCRBY', KEYS[2], prompt)
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 0
"""


class RedisRateLimiter:
    def __init__(self, redis_url: str, *, prefix: str) -> None:
        self._client = aioredis.from_url(redis_url)
        self._prefix = prefix
        self._admit = self._client.register_script(_ADMIT_LUA)
        self._charge_prompt = self._client.register_script(_CHARGE_PROMPT_LUA)

    def _keys(self, key_id: str, window: int) -> list[str]:
        base = f"{self._prefix}ratelimit:{key_id}:{window}"
        return [base + ":requests", base + ":tokens"]

    async def admit(self, key_id: str, limits: Limits, *, num_prompt_tokens: int, num_requests: int = 1) -> None:
        if not limits.rpm and not limits.tpm:
            return  # nothing to enforce: no Redis round trip on the request path (the counts are only for limits)
        window, retry_after_s = _window(time.time())
        reason = int(await self._admit(
            keys=self._keys(key_id, window),
            args=[limits.rpm, limits.tpm, num_prompt_tokens, 2 * WINDOW_S, num_requests],
        ))
        if reason:
            raise _rejection(reason, limits, retry_after_s)

    async def charge_prompt(self, key_id: str, limits: Limits, *, num_prompt_tokens: int, num_requests: int) -> None:
        if not limits.tpm:
            return
        window, retry_after_s = _window(time.time())
        reason = int(await self._charge_prompt(
            keys=self._keys(key_id, window), args=[limits.tpm, num_prompt_tokens, 2 * WINDOW_S, num_requests],
        ))
        if reason:
            raise _rejection(reason, limits, retry_after_s)

    async def add_tokens(self, key_id: str, limits: Limits, num_tokens: int) -> None:
        if not limits.tpm or num_tokens <= 0:
            return
        window, _ = _window(time.time())
        tokens_key = self._keys(key_id, window)[1]
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.incrby(tokens_key, num_tokens)
            pipe.expire(tokens_key, 2 * WINDOW_S)
            await pipe.execute()

    async def close(self) -> None:
        await self._client.aclose()


def make_rate_limiter(redis_url: str | None, *, prefix: str) -> RateLimiter:
    if redis_url:
        return RedisRateLimiter(redis_url, prefix=prefix)
    return InProcessRateLimiter()
