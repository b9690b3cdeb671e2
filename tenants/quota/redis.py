"""Redis quota store: the contract shared by every gateway replica.

Every operation that touches more than one key is ONE Lua script (EVALSHA through
redis-py's register_script), so reserve, settle, renew, charge and usage each cost one
round trip and run atomically on the server. The scripts read the clock with TIME, so
all replicas share the Redis server's clock. Every key a script touches is passed in
KEYS (nothing is derived inside the script), so Redis ACL key patterns apply; in Redis
Cluster, give the store a prefix with a hash tag (e.g. "{tollgate}:quota:") so that
all keys live in one slot.

Key layout, with P the prefix (default "tollgate:quota:") and S a scope key:

    P s:S:st     HASH  spent:<period> -> micros charged; reserved:<period> -> micros held
                       by live leases; wtokens -> tokens in the window (running total)
    P s:S:lease  ZSET  reservation id -> lease expiry (us, Redis TIME)
    P s:S:held   HASH  reservation id -> "<cost_micros> <period>" for each live lease
    P s:S:win    ZSET  reservation id -> admission time (us): the requests in the window
    P s:S:wtok   HASH  reservation id -> tokens of that admission (worst case, then actual)
    P active     ZSET  scope key -> earliest lease expiry in that scope (a lower bound;
                       the sweep visits scopes whose score has passed)
    P done:<id>  STRING "1" with a TTL: this reservation or charge id was charged

Window and lease entries leave as they age or are released (Redis drops empty keys);
st keeps one spent field per period and is never expired, since it is the budget.
Amounts and times are integers below 2**53, exact in Lua's doubles; every number a
script sends back to Redis goes through string.format('%d') to stay out of exponent form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from tenants.quota.contract import (
    DEFAULT_SETTLED_TTL_S,
    WINDOW_S,
    Denied,
    DenyReason,
    Granted,
    Reservation,
    ReservationIdError,
    ReserveRequest,
    ScopeUsage,
    SettleResult,
    check_charge,
    check_lease,
    check_settle,
    check_window,
    retry_after,
    window_status,
)

DEFAULT_PREFIX = "tollgate:quota:"

# Helpers shared by the scripts (prepended to each). A scope is addressed by its keys:
# st, lease, held, win, wtok as in the module docstring.
_LUA_HELPERS = """
local WINDOW = 60000000  -- the sliding window (us); scripts that prune set it from ARGV
local PAGE = 256         -- entries handled per command when walking a ZSET

local function int(x) return string.format('%d', x) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- HINCRBY that deletes the field when it reaches zero (keeps hashes small).
local function add(h, field, delta)
  if delta ~= 0 and redis.call('HINCRBY', h, field, int(delta)) == 0 then
    redis.call('HDEL', h, field)
  end
end

-- Release every lease of one scope that expired (expiry <= now): its reserved cost
-- goes back to its period and its slot frees. Returns how many were released.
local function expire_scope(st, lease, held, now)
  local released = 0
  while true do
    local ids = redis.call('ZRANGEBYSCORE', lease, '-inf', int(now), 'LIMIT', 0, PAGE)
    if #ids == 0 then return released end
    local values = redis.call('HMGET', held, unpack(ids))
    for i = 1, #ids do
      if values[i] then
        local cost, period = string.match(values[i], '^(%d+) (.+)$')
        add(st, 'reserved:' .. period, -tonumber(cost))
      end
    end
    redis.call('HDEL', held, unpack(ids))
    redis.call('ZREM', lease, unpack(ids))
    released = released + #ids
  end
end

-- Drop admissions that left the window (time <= now - WINDOW) and their tokens.
local function prune_window(st, win, wtok, now)
  local cutoff = int(now - WINDOW)
  while true do
    local ids = redis.call('ZRANGEBYSCORE', win, '-inf', cutoff, 'LIMIT', 0, PAGE)
    if #ids == 0 then return end
    local amounts = redis.call('HMGET', wtok, unpack(ids))
    local sum = 0
    for i = 1, #ids do sum = sum + (tonumber(amounts[i]) or 0) end
    redis.call('HDEL', wtok, unpack(ids))
    redis.call('ZREM', win, unpack(ids))
    add(st, 'wtokens', -sum)
  end
end

-- Set the scope's score in `active` to its earliest lease expiry (or remove it).
local function touch_active(active, lease, name)
  local first = redis.call('ZRANGE', lease, 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('ZREM', active, name)
  else
    redis.call('ZADD', active, first[2], name)
  end
end

-- Requests and tokens in the window, and the newest admission time (-1 if empty).
local function window_state(st, win)
  local count = redis.call('ZCARD', win)
  local total = tonumber(redis.call('HGET', st, 'wtokens') or 0)
  local newest = redis.call('ZRANGE', win, -1, -1, 'WITHSCORES')
  if #newest == 0 then return count, total, -1 end
  return count, total, tonumber(newest[2])
end
"""

# reserve: check every limit of every scope; if all pass, charge all scopes.
# KEYS[1]            active ZSET
# KEYS[2]            done marker of this reservation id
# KEYS[3+5(i-1)..]   scope i (i = 1..n): st, lease, held, win, wtok
# ARGV[1] reservation id   ARGV[2] tokens (worst case)   ARGV[3] cost micros (worst case)
# ARGV[4] period           ARGV[5] lease (us)            ARGV[6] window (us)
# ARGV[7] n (number of scopes)
# ARGV[8+5(i-1)..]   scope i: name, rpm, tpm, max_concurrent, budget (-1 = unlimited)
# Returns {code, reason, scope index, retry us, now, count, tokens, newest} where code is
# 1 granted, 2 granted before (live lease: a retry), 0 denied (reason 1 rpm, 2 tpm,
# 3 concurrency, 4 budget; retry -1 = waiting cannot help), -1 id already settled,
# -2 id expired but still in the window; the last three are scope 1's window after it.
RESERVE_LUA = (
    _LUA_HELPERS
    + """
-- Microseconds until enough admissions leave the window to free `need` tokens.
local function tokens_retry(win, wtok, need, now)
  local freed, start = 0, 0
  while true do
    local page = redis.call('ZRANGE', win, start, start + PAGE - 1, 'WITHSCORES')
    if #page == 0 then return WINDOW end
    local ids = {}
    for j = 1, #page, 2 do ids[#ids + 1] = page[j] end
    local amounts = redis.call('HMGET', wtok, unpack(ids))
    for j = 1, #ids do
      freed = freed + (tonumber(amounts[j]) or 0)
      if freed >= need then return tonumber(page[2 * j]) + WINDOW - now end
    end
    start = start + PAGE
  end
end

local active, done = KEYS[1], KEYS[2]
local rid, tokens, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local period, lease_us, n = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[7])
WINDOW = tonumber(ARGV[6])
local now = now_us()

if redis.call('EXISTS', done) == 1 then return {-1} end
for i = 1, n do
  local k = 2 + 5 * (i - 1)
  if expire_scope(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], now) > 0 then
    touch_active(active, KEYS[k + 2], ARGV[8 + 5 * (i - 1)])
  end
  prune_window(KEYS[k + 1], KEYS[k + 4], KEYS[k + 5], now)
end
if redis.call('ZSCORE', KEYS[4], rid) then
  local count, total, newest = window_state(KEYS[3], KEYS[6])
  return {2, 0, 0, -1, now, count, total, newest}
end
if redis.call('ZSCORE', KEYS[6], rid) then return {-2} end

local spent_field, reserved_field = 'spent:' .. period, 'reserved:' .. period
local count1, total1 = 0, 0  -- scope 1's window before this admission
for i = 1, n do
  local k, a = 2 + 5 * (i - 1), 7 + 5 * (i - 1)
  local st, lease, win, wtok = KEYS[k + 1], KEYS[k + 2], KEYS[k + 4], KEYS[k + 5]
  local rpm, tpm = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local max_concurrent, budget = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local count = redis.call('ZCARD', win)
  local counters = redis.call('HMGET', st, 'wtokens', spent_field, reserved_field)
  local total = tonumber(counters[1] or 0)
  if i == 1 then count1, total1 = count, total end
  local reason, retry = 0, -1
  if rpm >= 0 and count >= rpm then
    reason = 1
    if rpm > 0 then
      local oldest = redis.call('ZRANGE', win, count - rpm, count - rpm, 'WITHSCORES')
      retry = tonumber(oldest[2]) + WINDOW - now
    end
  elseif tpm >= 0 and total + tokens > tpm then
    reason = 2
    if tokens <= tpm then retry = tokens_retry(win, wtok, total + tokens - tpm, now) end
  elseif max_concurrent >= 0 and redis.call('ZCARD', lease) >= max_concurrent then
    reason = 3
    if max_concurrent > 0 then
      retry = tonumber(redis.call('ZRANGE', lease, 0, 0, 'WITHSCORES')[2]) - now
    end
  elseif budget >= 0
      and tonumber(counters[2] or 0) + tonumber(counters[3] or 0) + cost > budget then
    reason = 4
  end
  if reason > 0 then
    local count1, total1, newest1 = window_state(KEYS[3], KEYS[6])
    return {0, reason, i, retry, now, count1, total1, newest1}
  end
end

local expiry = int(now + lease_us)
local held_value = int(cost) .. ' ' .. period
for i = 1, n do
  local k = 2 + 5 * (i - 1)
  local st, lease, held, win, wtok = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  redis.call('ZADD', win, int(now), rid)
  redis.call('HSET', wtok, rid, int(tokens))
  add(st, 'wtokens', tokens)
  redis.call('ZADD', lease, expiry, rid)
  redis.call('HSET', held, rid, held_value)
  add(st, reserved_field, cost)
  redis.call('ZADD', active, 'LT', expiry, ARGV[8 + 5 * (i - 1)])
end
return {1, 0, 0, -1, now, count1 + 1, total1 + tokens, now}
"""
)

# settle: release the lease if live, put the actual tokens in the window, charge once.
# KEYS[1]            active ZSET
# KEYS[2]            done marker of this reservation id
# KEYS[3+5(i-1)..]   scope i: st, lease, held, win, wtok
# ARGV[1] reservation id   ARGV[2] actual tokens   ARGV[3] actual cost micros
# ARGV[4] period of the reservation   ARGV[5] done marker TTL (s)   ARGV[6] window (us)
# ARGV[7] n          ARGV[7+i] name of scope i
# Returns {released (0/1), charged (0/1)}.
SETTLE_LUA = (
    _LUA_HELPERS
    + """
local active, done = KEYS[1], KEYS[2]
local rid, actual_tokens, actual_cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local period, ttl, n = ARGV[4], ARGV[5], tonumber(ARGV[7])
WINDOW = tonumber(ARGV[6])
local now = now_us()

local released = 0
for i = 1, n do
  local k = 2 + 5 * (i - 1)
  local st, lease, held = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local expired = expire_scope(st, lease, held, now)
  prune_window(st, KEYS[k + 4], KEYS[k + 5], now)
  local value = redis.call('HGET', held, rid)
  if value then
    local cost, held_period = string.match(value, '^(%d+) (.+)$')
    add(st, 'reserved:' .. held_period, -tonumber(cost))
    redis.call('HDEL', held, rid)
    redis.call('ZREM', lease, rid)
    released = 1
  end
  if value or expired > 0 then touch_active(active, lease, ARGV[7 + i]) end
end
local charged = 0
if redis.call('SET', done, '1', 'NX', 'EX', ttl) then charged = 1 end
if released == 1 or charged == 1 then
  for i = 1, n do
    local k = 2 + 5 * (i - 1)
    local st, wtok = KEYS[k + 1], KEYS[k + 5]
    local old = redis.call('HGET', wtok, rid)
    if old then
      redis.call('HSET', wtok, rid, int(actual_tokens))
      add(st, 'wtokens', actual_tokens - tonumber(old))
    end
    if charged == 1 then add(st, 'spent:' .. period, actual_cost) end
  end
end
return {released, charged}
"""
)

# renew: move live leases to now + lease; expired ones stay expired.
# KEYS[1]            active ZSET
# KEYS[1+j]          lease ZSET of scope j (j = 1..m)
# ARGV[1] lease (us)   ARGV[2] m
# then for each scope j: its name, the number c of ids, and the c reservation ids
# Returns, for each scope j, the list of ids renewed there.
RENEW_LUA = (
    _LUA_HELPERS
    + """
local active, lease_us, m = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_us()
local expiry = int(now + lease_us)
local result, a = {}, 3
for j = 1, m do
  local lease, name, c = KEYS[1 + j], ARGV[a], tonumber(ARGV[a + 1])
  local renewed = {}
  for x = a + 2, a + 1 + c do
    local score = redis.call('ZSCORE', lease, ARGV[x])
    if score and tonumber(score) > now then
      redis.call('ZADD', lease, 'XX', expiry, ARGV[x])
      renewed[#renewed + 1] = ARGV[x]
    end
  end
  if #renewed > 0 then redis.call('ZADD', active, 'LT', expiry, name) end
  result[j] = renewed
  a = a + 2 + c
end
return result
"""
)

# charge: add a cost to spent in every scope, once per charge id.
# KEYS[1]    done marker of this charge id
# KEYS[1+i]  st HASH of scope i
# ARGV[1] period   ARGV[2] cost micros   ARGV[3] done marker TTL (s)
# Returns 1 if this call charged, 0 if the id was charged already.
CHARGE_LUA = (
    _LUA_HELPERS
    + """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then return 0 end
for i = 2, #KEYS do add(KEYS[i], 'spent:' .. ARGV[1], tonumber(ARGV[2])) end
return 1
"""
)

# usage: counters of one scope, after releasing its expired leases.
# KEYS[1] active ZSET   KEYS[2..6] the scope's st, lease, held, win, wtok
# ARGV[1] scope name   ARGV[2] period   ARGV[3] window (us)
# Returns {spent, reserved, concurrent, requests in window, tokens in window}.
USAGE_LUA = (
    _LUA_HELPERS
    + """
local st, lease, held, win, wtok = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
WINDOW = tonumber(ARGV[3])
local now = now_us()
if expire_scope(st, lease, held, now) > 0 then touch_active(KEYS[1], lease, ARGV[1]) end
prune_window(st, win, wtok, now)
local counters = redis.call('HMGET', st, 'spent:' .. ARGV[2], 'reserved:' .. ARGV[2], 'wtokens')
return {tonumber(counters[1] or 0), tonumber(counters[2] or 0), redis.call('ZCARD', lease),
        redis.call('ZCARD', win), tonumber(counters[3] or 0)}
"""
)

# due: the scopes whose earliest lease has expired (first step of the sweep).
# KEYS[1] active ZSET   ARGV[1] most scopes to return
DUE_LUA = (
    _LUA_HELPERS
    + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', int(now_us()), 'LIMIT', 0, ARGV[1])
"""
)

# expire: release the expired leases of the given scopes (second step of the sweep).
# KEYS[1] active ZSET   KEYS[2+3(i-1)..] scope i: st, lease, held   ARGV[i] name of scope i
# Returns the number of leases released.
EXPIRE_LUA = (
    _LUA_HELPERS
    + """
local now = now_us()
local released = 0
for i = 1, #ARGV do
  local k = 2 + 3 * (i - 1)
  released = released + expire_scope(KEYS[k], KEYS[k + 1], KEYS[k + 2], now)
  touch_active(KEYS[1], KEYS[k + 1], ARGV[i])
end
return released
"""
)

_SWEEP_BATCH = 100
_SWEEP_MAX_ROUNDS = 1000


def _limit(value: int | None) -> int:
    return -1 if value is None else value


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisQuotaStore:
    """The quota store contract on Redis (shared by replicas).

    `client` is a redis.asyncio.Redis (decode_responses either way); the store does not
    close it unless it was opened by from_url().
    """

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        settled_ttl_s: int = DEFAULT_SETTLED_TTL_S,
        window_s: float = WINDOW_S,
        owns_client: bool = False,
    ) -> None:
        if settled_ttl_s < 1:
            raise ValueError("settled_ttl_s must be at least 1 second")
        self._window_us = check_window(window_s)
        self._client = client
        self._prefix = prefix
        self._settled_ttl_s = int(settled_ttl_s)
        self._owns_client = owns_client
        self._active = f"{prefix}active"
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._charge = client.register_script(CHARGE_LUA)
        self._usage = client.register_script(USAGE_LUA)
        self._due = client.register_script(DUE_LUA)
        self._expire = client.register_script(EXPIRE_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisQuotaStore:
        """A store on its own connection pool (closed by aclose())."""
        return cls(Redis.from_url(url), owns_client=True, **kwargs)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _scope_keys(self, scope: str) -> list[str]:
        base = f"{self._prefix}s:{scope}:"
        return [base + "st", base + "lease", base + "held", base + "win", base + "wtok"]

    def _done_key(self, charge_id: str) -> str:
        return f"{self._prefix}done:{charge_id}"

    async def reserve(self, request: ReserveRequest) -> Granted | Denied:
        rid = request.reservation_id
        keys = [self._active, self._done_key(rid)]
        args: list[str | int] = [
            rid,
            request.tokens,
            request.cost_micros,
            request.period,
            check_lease(request.lease_s),
            self._window_us,
            len(request.scopes),
        ]
        for scope in request.scopes:
            keys += self._scope_keys(scope.key)
            limits = scope.limits
            args += [
                scope.key,
                _limit(limits.rpm),
                _limit(limits.tpm),
                _limit(limits.max_concurrent),
                _limit(limits.budget_micros),
            ]
        result = await self._reserve(keys=keys, args=args)
        code = int(result[0])
        if code == -1:
            raise ReservationIdError(f"reservation {rid!r} was already settled")
        if code == -2:
            raise ReservationIdError(f"reservation {rid!r} expired and is still in the window")
        _, reason_code, index, retry_us, now, count, total, newest = (int(v) for v in result)
        first = request.scopes[0].limits
        requests = window_status(first.rpm, count, newest, now, self._window_us)
        tokens = window_status(first.tpm, total, newest, now, self._window_us)
        if code == 0:
            reason = _REASONS[reason_code]
            return Denied(
                reason,
                request.scopes[index - 1].key,
                retry_after(reason, retry_us),
                requests,
                tokens,
            )
        return Granted(request.reservation, requests, tokens)

    async def renew(self, reservations: Sequence[Reservation], lease_s: float) -> set[str]:
        lease_us = check_lease(lease_s)
        by_scope: dict[str, list[str]] = {}
        first_scope: dict[str, str] = {}
        for reservation in reservations:
            first_scope[reservation.reservation_id] = reservation.scope_keys[0]
            for key in reservation.scope_keys:
                by_scope.setdefault(key, []).append(reservation.reservation_id)
        if not by_scope:
            return set()
        keys = [self._active]
        args: list[str | int] = [lease_us, len(by_scope)]
        for scope, ids in by_scope.items():
            keys.append(self._scope_keys(scope)[1])
            args += [scope, len(ids), *ids]
        result = await self._renew(keys=keys, args=args)
        renewed: set[str] = set()
        for scope, ids in zip(by_scope, result, strict=True):
            renewed.update(rid for rid in map(_text, ids) if first_scope[rid] == scope)
        return renewed

    async def settle(
        self, reservation: Reservation, actual_tokens: int, actual_cost_micros: int
    ) -> SettleResult:
        check_settle(actual_tokens, actual_cost_micros)
        rid = reservation.reservation_id
        keys = [self._active, self._done_key(rid)]
        for scope in reservation.scope_keys:
            keys += self._scope_keys(scope)
        args: list[str | int] = [
            rid,
            actual_tokens,
            actual_cost_micros,
            reservation.period,
            self._settled_ttl_s,
            self._window_us,
            len(reservation.scope_keys),
            *reservation.scope_keys,
        ]
        released, charged = await self._settle(keys=keys, args=args)
        return SettleResult(bool(released), bool(charged))

    async def charge(
        self, charge_id: str, scope_keys: Sequence[str], period: str, cost_micros: int
    ) -> bool:
        check_charge(charge_id, scope_keys, period, cost_micros)
        keys = [self._done_key(charge_id)] + [self._scope_keys(s)[0] for s in scope_keys]
        result = await self._charge(keys=keys, args=[period, cost_micros, self._settled_ttl_s])
        return bool(result)

    async def charged(self, charge_ids: Sequence[str]) -> set[str]:
        if not charge_ids:
            return set()
        values = await self._client.mget([self._done_key(cid) for cid in charge_ids])
        return {cid for cid, value in zip(charge_ids, values, strict=True) if value is not None}

    async def usage(self, scope_key: str, period: str) -> ScopeUsage:
        keys = [self._active, *self._scope_keys(scope_key)]
        spent, reserved, concurrent, requests, tokens = await self._usage(
            keys=keys, args=[scope_key, period, self._window_us]
        )
        return ScopeUsage(int(spent), int(reserved), int(concurrent), int(requests), int(tokens))

    async def expire_leases(self) -> int:
        """Sweep: two round trips per batch of due scopes (which scopes, then release)."""
        released = 0
        for _ in range(_SWEEP_MAX_ROUNDS):
            due = [
                _text(name) for name in await self._due(keys=[self._active], args=[_SWEEP_BATCH])
            ]
            if not due:
                break
            keys = [self._active]
            for scope in due:
                keys += self._scope_keys(scope)[:3]
            released += int(await self._expire(keys=keys, args=due))
            if len(due) < _SWEEP_BATCH:
                break
        return released

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


_REASONS = {
    1: DenyReason.RPM,
    2: DenyReason.TPM,
    3: DenyReason.CONCURRENCY,
    4: DenyReason.BUDGET,
}
