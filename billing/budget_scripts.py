"""Redis Lua scripts that reserve and settle budget holds atomically (see billing/quotas.py).

Per (tenant, scope): a hash `held` with the outstanding totals (`tokens`,
`cost`) and each reservation's amounts (`r:<request id>` = "tokens:cost"),
and a sorted set `expiry` of request ids by the time their hold lapses. The
month's recorded spend is the `spend` hash the counters have always used.
Amounts travel as decimal strings and are changed with HINCRBY only: Lua
numbers are doubles, which cannot hold pico-USD sums exactly (comparisons
against a limit can).
"""

from __future__ import annotations

_RELEASE = """
local function subtract(key, field, amount)
  if amount ~= '0' then redis.call('HINCRBY', key, field, '-' .. amount) end
end
local function release(held, expiry, id)
  redis.call('ZREM', expiry, id)
  local amounts = redis.call('HGET', held, 'r:' .. id)
  if not amounts then return end
  local sep = string.find(amounts, ':', 1, true)
  subtract(held, 'tokens', string.sub(amounts, 1, sep - 1))
  subtract(held, 'cost', string.sub(amounts, sep + 1))
  redis.call('HDEL', held, 'r:' .. id)
end
"""

# KEYS: per hold, 3 keys: spend, held, expiry.
# ARGV: now, expires_at, request id, hold ttl (s), amount tokens, amount cost, floor tokens, floor cost,
#       then per hold: token limit, cost limit ('-1': none).
# Returns 0 when reserved, else {hold index (1-based), 0 tokens | 1 cost, used tokens, used cost}.
RESERVE = _RELEASE + """
local now, expires_at, id, ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local amount_tokens, amount_cost = ARGV[5], ARGV[6]
local floor_tokens, floor_cost = tonumber(ARGV[7]), tonumber(ARGV[8])
local num_holds = #KEYS / 3
for i = 0, num_holds - 1 do
  local spend, held, expiry = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  for _, lapsed in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now)) do release(held, expiry, lapsed) end
  local token_limit, cost_limit = tonumber(ARGV[9 + 2 * i]), tonumber(ARGV[10 + 2 * i])
  local spent = redis.call('HMGET', spend, 'tokens', 'cost')
  local holding = redis.call('HMGET', held, 'tokens', 'cost')
  local used_tokens = tonumber(spent[1] or '0') + tonumber(holding[1] or '0')
  local used_cost = tonumber(spent[2] or '0') + tonumber(holding[2] or '0')
  if token_limit >= 0 and (used_tokens >= token_limit or used_tokens + floor_tokens > token_limit) then
    return {i + 1, 0, used_tokens, used_cost}
  end
  if cost_limit >= 0 and (used_cost >= cost_limit or used_cost + floor_cost > cost_limit) then
    return {i + 1, 1, used_tokens, used_cost}
  end
end
for i = 0, num_holds - 1 do
  local held, expiry = KEYS[3 * i + 2], KEYS[3 * i + 3]
  release(held, expiry, id)
  redis.call('HSET', held, 'r:' .. id, amount_tokens .. ':' .. amount_cost)
  redis.call('HINCRBY', held, 'tokens', amount_tokens)
  redis.call('HINCRBY', held, 'cost', amount_cost)
  redis.call('ZADD', expiry, expires_at, id)
  redis.call('EXPIRE', held, ttl)
  redis.call('EXPIRE', expiry, ttl)
end
return 0
"""

# KEYS: per scope, 3 keys: spend, held, expiry. ARGV: request id, actual tokens, actual cost, spend ttl (s).
SETTLE = _RELEASE + """
local id, tokens, cost, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
for i = 0, #KEYS / 3 - 1 do
  local spend, held, expiry = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  release(held, expiry, id)
  redis.call('HINCRBY', spend, 'tokens', tokens)
  redis.call('HINCRBY', spend, 'cost', cost)
  redis.call('EXPIRE', spend, ttl)
end
return 0
"""
