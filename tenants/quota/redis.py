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
                       by live leases; wtokens -> tokens in the window (running total);
                       cut:<period> -> the last rebase's cutoff (us, ledger clock);
                       recent:<period> -> micros of the charges at or after it
    P s:S:lease  ZSET  reservation id -> lease expiry (us, Redis TIME)
    P s:S:held   HASH  reservation id -> "<cost_micros> <period>" for each live lease
    P s:S:win    ZSET  reservation id -> admission time (us): the requests in the window
    P s:S:wtok   HASH  reservation id -> tokens of that admission (worst case, then actual)
    P active     ZSET  scope key -> earliest lease expiry in that scope (a lower bound;
                       the sweep visits scopes whose score has passed)
    P s:S:chg:<period>   ZSET  charge id -> its ledger row's time (us): charges taken
                       since the cutoff, so a rebase can tell which the ledger base holds
    P s:S:chgc:<period>  HASH  charge id -> its cost (micros)
    P done:<id>  STRING "1" with a TTL: this reservation or charge id was charged
    P ready:<period>     STRING "<not before (us, Redis TIME)> <token>": a rebuild of
                       the period finished since the store came up empty (never expires)
    P rebuild:<token>    STRING a rebuild in progress (lost if Redis restarts meanwhile)

Window and lease entries leave as they age or are released (Redis drops empty keys);
st keeps one spent field per period and is never expired, since it is the budget.
Amounts and times are integers below 2**53, exact in Lua's doubles; every number a
script sends back to Redis goes through string.format('%d') to stay out of exponent form.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import hiredis
from redis import exceptions
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript

from tenants.quota.contract import (
    DEFAULT_SETTLED_TTL_S,
    WINDOW_S,
    Denied,
    DenyReason,
    Granted,
    Reservation,
    ReservationIdError,
    ReserveRequest,
    Scope,
    ScopeUsage,
    SettleResult,
    SpendUnknownError,
    StoreUnavailableError,
    WindowStatus,
    binding,
    check_charge,
    check_lease,
    check_rebase,
    check_settle,
    check_window,
    retry_after,
    wall_us,
    window_status,
    window_timing,
)

DEFAULT_PREFIX = "tollgate:quota:"
HEALTH_CHECK_INTERVAL_S = 5
"""A pooled connection idle this long is PINGed before use, so the first command after
a Redis restart does not fail on a dead socket."""
T = TypeVar("T")


MAX_CONNECTIONS = 128  # a client's connections at most: see WaitingConnectionPool
POOL_WAIT_S = 5.0  # how long a caller waits for a connection when all are in use


class WaitingConnectionPool(ConnectionPool):
    """redis-py's pool, whose callers past max_connections wait (up to POOL_WAIT_S) for a
    connection to come back instead of failing at once. The default pool refuses its
    101st caller (MaxConnectionsError): a burst of concurrent requests was answered 503
    "the quota store is unavailable" while Redis was fine. BlockingConnectionPool waits
    too, but pays for it on every call (a condition, a lock and a timer): ~0.15 ms a
    request at c=1 here; this pool pays only when it is exhausted. Redis answers in well
    under a millisecond, so a short wait costs less than opening hundreds of connections."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        try:
            return await self._take(*args, **kwargs)
        except exceptions.MaxConnectionsError:
            pass
        try:
            async with asyncio.timeout(POOL_WAIT_S):
                while True:
                    await self._returned()
                    try:
                        return await self._take(*args, **kwargs)
                    except exceptions.MaxConnectionsError:
                        continue  # another caller took it first: wait for the next
        except TimeoutError:
            raise exceptions.ConnectionError("no Redis connection came free in time") from None

    async def _take(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        connection: AbstractConnection = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        return connection

    async def _returned(self) -> None:
        """Until a connection comes back to the pool (first come, first woken)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken, then cancelled: the connection is someone else's
            else:
                waiter.cancel()
            raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def release(self, connection: AbstractConnection) -> None:
        try:
            await super().release(connection)
        finally:
            self._wake_one()


def connect(url: str) -> Redis:
    """A client that checks idle connections and retries a command on a new connection
    when one was lost (every quota operation is idempotent, so a retry is safe), on a
    pool of at most MAX_CONNECTIONS that callers wait for when it is exhausted."""
    pool = WaitingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
        retry_on_error=[exceptions.ConnectionError, exceptions.TimeoutError],
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
    )
    return Redis.from_pool(pool)


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

-- Remove the ids scored up to `upto` (a ZRANGEBYSCORE bound) from the ZSET `times` and
-- the HASH `amounts`, and take the sum of their amounts off st's `field`.
local function drain(st, field, times, amounts, upto)
  while true do
    local ids = redis.call('ZRANGEBYSCORE', times, '-inf', upto, 'LIMIT', 0, PAGE)
    if #ids == 0 then return end
    local values = redis.call('HMGET', amounts, unpack(ids))
    local sum = 0
    for i = 1, #ids do sum = sum + (tonumber(values[i]) or 0) end
    redis.call('HDEL', amounts, unpack(ids))
    redis.call('ZREM', times, unpack(ids))
    add(st, field, -sum)
  end
end

-- Drop admissions that left the window (time <= now - WINDOW) and their tokens.
local function prune_window(st, win, wtok, now)
  drain(st, 'wtokens', win, wtok, int(now - WINDOW))
end

-- Charge a ledger row's cost to one scope, unless the row is older than the scope's
-- cutoff (its cost is in the base the last rebase set).
local function credit(st, chg, chgc, period, id, at, cost)
  local cut = tonumber(redis.call('HGET', st, 'cut:' .. period) or -1)
  if at < cut or cost == 0 then return end
  add(st, 'spent:' .. period, cost)
  add(st, 'recent:' .. period, cost)
  redis.call('ZADD', chg, int(at), id)
  redis.call('HSET', chgc, id, int(cost))
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
# KEYS[3+5n]         ready marker of the period   ARGV[8+5n] guard (1: require it)
# Returns {code, reason, scope index, retry us, now, then count, tokens, newest of each
# scope's window after it} where code is 1 granted, 2 granted before (live lease: a
# retry), 0 denied (reason 1 rpm, 2 tpm, 3 concurrency, 4 budget; retry -1 = waiting
# cannot help), -1 id already settled, -2 id expired but still in the window,
# -3 {-3, retry us}: spend not rebuilt yet.
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

-- `head` followed by every scope's window state (count, tokens, newest): the headers
-- describe the scope that binds. Scope i's state and window at
-- KEYS[3 + 5 * (i - 1)] and KEYS[6 + 5 * (i - 1)].
local function with_windows(head, n)
  for i = 1, n do
    local k = 2 + 5 * (i - 1)
    local count, total, newest = window_state(KEYS[k + 1], KEYS[k + 4])
    head[#head + 1] = count
    head[#head + 1] = total
    head[#head + 1] = newest
  end
  return head
end

local active, done = KEYS[1], KEYS[2]
local rid, tokens, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local period, lease_us, n = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[7])
WINDOW = tonumber(ARGV[6])
local now = now_us()

if ARGV[8 + 5 * n] == '1' then
  local ready = redis.call('GET', KEYS[3 + 5 * n])
  if not ready then return {-3, 1000000} end
  local not_before = tonumber(string.match(ready, '^(%d+)'))
  if not_before > now then return {-3, not_before - now} end
end
if redis.call('EXISTS', done) == 1 then return {-1} end
for i = 1, n do
  local k = 2 + 5 * (i - 1)
  if expire_scope(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], now) > 0 then
    touch_active(active, KEYS[k + 2], ARGV[8 + 5 * (i - 1)])
  end
  prune_window(KEYS[k + 1], KEYS[k + 4], KEYS[k + 5], now)
end
if redis.call('ZSCORE', KEYS[4], rid) then return with_windows({2, 0, 0, -1, now}, n) end
if redis.call('ZSCORE', KEYS[6], rid) then return {-2} end

local spent_field, reserved_field = 'spent:' .. period, 'reserved:' .. period
for i = 1, n do
  local k, a = 2 + 5 * (i - 1), 7 + 5 * (i - 1)
  local st, lease, win, wtok = KEYS[k + 1], KEYS[k + 2], KEYS[k + 4], KEYS[k + 5]
  local rpm, tpm = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local max_concurrent, budget = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local count = redis.call('ZCARD', win)
  local counters = redis.call('HMGET', st, 'wtokens', spent_field, reserved_field)
  local total = tonumber(counters[1] or 0)
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
  if reason > 0 then return with_windows({0, reason, i, retry, now}, n) end
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
return with_windows({1, 0, 0, -1, now}, n)
"""
)

# settle: release the lease if live, put the actual tokens in the window, charge once.
# KEYS[1]            active ZSET
# KEYS[2]            done marker of this reservation id
# KEYS[3+5(i-1)..]   scope i: st, lease, held, win, wtok
# ARGV[1] reservation id   ARGV[2] actual tokens   ARGV[3] actual cost micros
# ARGV[4] period of the reservation   ARGV[5] done marker TTL (s)   ARGV[6] window (us)
# ARGV[7] n          ARGV[7+i] name of scope i   ARGV[8+n] the ledger row's time (us)
# KEYS[3+5n+2(i-1)..] scope i: chg, chgc of the period
# Returns {released (0/1), charged (0/1)}.
SETTLE_LUA = (
    _LUA_HELPERS
    + """
local active, done = KEYS[1], KEYS[2]
local rid, actual_tokens, actual_cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local period, ttl, n = ARGV[4], ARGV[5], tonumber(ARGV[7])
local at = tonumber(ARGV[8 + n])
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
    if charged == 1 then
      local c = 3 + 5 * n + 2 * (i - 1)
      credit(st, KEYS[c], KEYS[c + 1], period, rid, at, actual_cost)
    end
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
# KEYS[1]              done marker of this charge id
# KEYS[2+3(i-1)..]     scope i: st, chg, chgc of the period
# ARGV[1] period   ARGV[2] cost micros   ARGV[3] done marker TTL (s)   ARGV[4] row time (us)
# ARGV[5] charge id
# Returns 1 if this call charged, 0 if the id was charged already.
CHARGE_LUA = (
    _LUA_HELPERS
    + """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then return 0 end
local cost, at = tonumber(ARGV[2]), tonumber(ARGV[4])
for k = 2, #KEYS, 3 do credit(KEYS[k], KEYS[k + 1], KEYS[k + 2], ARGV[1], ARGV[5], at, cost) end
return 1
"""
)

# restore: give a reservation that is not settled its lease back where it is missing.
# KEYS[1] active ZSET   KEYS[2] done marker   KEYS[3+3(i-1)..] scope i: st, lease, held
# ARGV[1] reservation id   ARGV[2] cost   ARGV[3] period   ARGV[4] lease (us)
# ARGV[4+i] name of scope i
# Returns 1 if a lease was re-created in some scope.
RESTORE_LUA = (
    _LUA_HELPERS
    + """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local rid, cost, period = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = now_us()
local expiry = int(now + tonumber(ARGV[4]))
local restored = 0
for i = 1, (#KEYS - 2) / 3 do
  local st, lease, held = KEYS[3 * i], KEYS[3 * i + 1], KEYS[3 * i + 2]
  expire_scope(st, lease, held, now)
  if not redis.call('ZSCORE', lease, rid) then
    redis.call('ZADD', lease, expiry, rid)
    redis.call('HSET', held, rid, int(cost) .. ' ' .. period)
    add(st, 'reserved:' .. period, cost)
    restored = 1
  end
  touch_active(KEYS[1], lease, ARGV[4 + i])
end
return restored
"""
)

# rebase: spent = the ledger's base before the cutoff + the charges taken at or after it.
# KEYS[1+3(i-1)..] scope i: st, chg, chgc of the period
# ARGV[1] period   ARGV[2] cutoff (us, ledger clock)   ARGV[2+i] base of scope i
REBASE_LUA = (
    _LUA_HELPERS
    + """
local period, cutoff = ARGV[1], tonumber(ARGV[2])
for i = 1, #KEYS / 3 do
  local st, chg, chgc = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if cutoff >= tonumber(redis.call('HGET', st, 'cut:' .. period) or -1) then
    drain(st, 'recent:' .. period, chg, chgc, '(' .. int(cutoff))  -- the base holds those
    local recent = tonumber(redis.call('HGET', st, 'recent:' .. period) or 0)
    redis.call('HSET', st, 'spent:' .. period, int(tonumber(ARGV[2 + i]) + recent),
               'cut:' .. period, int(cutoff))
  end
end
return 1
"""
)

# finish: mark the period known, if the rebuild's token survived (no restart meanwhile).
# KEYS[1] rebuild:<token>   KEYS[2] ready:<period>   ARGV[1] hold (us)   ARGV[2] token
FINISH_LUA = (
    _LUA_HELPERS
    + """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[2], int(now_us() + tonumber(ARGV[1])) .. ' ' .. ARGV[2])
end
return 1
"""
)

# usage: counters of one scope, after releasing its expired leases.
# KEYS[1] active ZSET   KEYS[2..6] the scope's st, lease, held, win, wtok
# ARGV[1] scope name   ARGV[2] period   ARGV[3] window (us)
# Returns {spent, reserved, concurrent, requests in window, tokens in window, now (us),
# oldest and newest admission in the window (us, -1: empty)}.
USAGE_LUA = (
    _LUA_HELPERS
    + """
local st, lease, held, win, wtok = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
WINDOW = tonumber(ARGV[3])
local now = now_us()
if expire_scope(st, lease, held, now) > 0 then touch_active(KEYS[1], lease, ARGV[1]) end
prune_window(st, win, wtok, now)
local counters = redis.call('HMGET', st, 'spent:' .. ARGV[2], 'reserved:' .. ARGV[2], 'wtokens')
local oldest = redis.call('ZRANGE', win, 0, 0, 'WITHSCORES')
local newest = redis.call('ZRANGE', win, -1, -1, 'WITHSCORES')
return {tonumber(counters[1] or 0), tonumber(counters[2] or 0), redis.call('ZCARD', lease),
        redis.call('ZCARD', win), tonumber(counters[3] or 0), now,
        tonumber(oldest[2] or -1), tonumber(newest[2] or -1)}
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
_REBASE_BATCH = 200  # scopes per rebase script: short enough not to stall Redis
_SWEEP_MAX_ROUNDS = 1000


async def _exchange(connection: AbstractConnection, command: bytes) -> Any:
    await connection.send_packed_command(command)  # PINGs first if idle (health check)
    return await connection.read_response()  # an error reply is raised


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
        guarded: bool = False,
    ) -> None:
        if settled_ttl_s < 1:
            raise ValueError("settled_ttl_s must be at least 1 second")
        self._window_us = check_window(window_s)
        self._client = client
        self._prefix = prefix
        self._settled_ttl_s = int(settled_ttl_s)
        self._owns_client = owns_client
        self._guarded = guarded  # refuse reserve() until the period's spend is rebuilt
        self._active = f"{prefix}active"
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._charge = client.register_script(CHARGE_LUA)
        self._usage = client.register_script(USAGE_LUA)
        self._due = client.register_script(DUE_LUA)
        self._expire = client.register_script(EXPIRE_LUA)
        self._restore = client.register_script(RESTORE_LUA)
        self._rebase = client.register_script(REBASE_LUA)
        self._finish = client.register_script(FINISH_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisQuotaStore:
        """A store on its own connection pool (closed by aclose())."""
        return cls(connect(url), owns_client=True, **kwargs)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _scope_keys(self, scope: str) -> list[str]:
        base = f"{self._prefix}s:{scope}:"
        return [base + "st", base + "lease", base + "held", base + "win", base + "wtok"]

    def _done_key(self, charge_id: str) -> str:
        return f"{self._prefix}done:{charge_id}"

    def _charge_keys(self, scope: str, period: str) -> list[str]:
        base = f"{self._prefix}s:{scope}:"
        return [f"{base}chg:{period}", f"{base}chgc:{period}"]

    def _ready_key(self, period: str) -> str:
        return f"{self._prefix}ready:{period}"

    async def _call(self, command: Callable[[], Awaitable[T]]) -> T:
        """Run one command; a lost or refused connection is StoreUnavailableError."""
        try:
            return await command()
        except (exceptions.ConnectionError, exceptions.TimeoutError) as exc:
            raise StoreUnavailableError(f"quota store unreachable: {exc}") from exc

    async def _script(self, script: AsyncScript, keys: list[str], args: list[str | int]) -> Any:
        """EVALSHA on a pooled connection, under the connection's retry policy (a lost
        connection is closed and the command sent again on a new one, as redis-py's
        execute_command does), without its per-command layers: the command packed once by
        hiredis, the reply read as it comes (EVALSHA has no reply callback). redis-py's
        path cost about 50 us of CPU more per call, and a request makes two. A script the
        server does not have (it restarted) is loaded, then run again."""
        words: tuple[Any, ...] = ("EVALSHA", script.sha, len(keys), *keys, *args)
        command = hiredis.pack_command(words)
        pool = self._client.connection_pool

        async def run() -> Any:
            connection: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
            try:
                return await connection.retry.call_with_retry(
                    lambda: _exchange(connection, command),
                    lambda error: connection.disconnect(error=error),
                )
            finally:
                await pool.release(connection)

        try:
            return await self._call(run)
        except exceptions.NoScriptError:
            await self._call(lambda: self._client.script_load(script.script))
            return await self._call(run)

    def _statuses(
        self, scopes: Sequence[Scope], windows: list[int], now: int
    ) -> tuple[WindowStatus, WindowStatus]:
        """The binding requests and tokens statuses, from each scope's (count, tokens,
        newest admission) as the script returns them."""
        requests, tokens = [], []
        for i, scope in enumerate(scopes):
            count, total, newest = windows[3 * i : 3 * i + 3]
            requests.append(window_status(scope.limits.rpm, count, newest, now, self._window_us))
            tokens.append(window_status(scope.limits.tpm, total, newest, now, self._window_us))
        return binding(requests), binding(tokens)

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
        keys.append(self._ready_key(request.period))
        args.append(1 if self._guarded else 0)
        result = await self._script(self._reserve, keys, args)
        code = int(result[0])
        if code == -3:
            raise SpendUnknownError(request.period, int(result[1]) / 1e6)
        if code == -1:
            raise ReservationIdError(f"reservation {rid!r} was already settled")
        if code == -2:
            raise ReservationIdError(f"reservation {rid!r} expired and is still in the window")
        _, reason_code, index, retry_us, now = (int(v) for v in result[:5])
        requests, tokens = self._statuses(request.scopes, [int(v) for v in result[5:]], now)
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
        result = await self._script(self._renew, keys, args)
        renewed: set[str] = set()
        for scope, ids in zip(by_scope, result, strict=True):
            renewed.update(rid for rid in map(_text, ids) if first_scope[rid] == scope)
        return renewed

    async def restore(self, reservations: Sequence[Reservation], lease_s: float) -> int:
        lease_us = check_lease(lease_s)
        restored = 0
        for r in reservations:  # rare (after a restart or a long outage): one call each
            keys = [self._active, self._done_key(r.reservation_id)]
            for scope in r.scope_keys:
                keys += self._scope_keys(scope)[:3]
            args: list[str | int] = [r.reservation_id, r.cost_micros, r.period, lease_us]
            restored += int(await self._script(self._restore, keys, [*args, *r.scope_keys]))
        return restored

    async def settle(
        self,
        reservation: Reservation,
        actual_tokens: int,
        actual_cost_micros: int,
        at_us: int | None = None,
    ) -> SettleResult:
        check_settle(actual_tokens, actual_cost_micros)
        rid = reservation.reservation_id
        keys = [self._active, self._done_key(rid)]
        for scope in reservation.scope_keys:
            keys += self._scope_keys(scope)
        for scope in reservation.scope_keys:
            keys += self._charge_keys(scope, reservation.period)
        args: list[str | int] = [
            rid,
            actual_tokens,
            actual_cost_micros,
            reservation.period,
            self._settled_ttl_s,
            self._window_us,
            len(reservation.scope_keys),
            *reservation.scope_keys,
            wall_us() if at_us is None else at_us,
        ]
        released, charged = await self._script(self._settle, keys, args)
        return SettleResult(bool(released), bool(charged))

    async def charge(
        self,
        charge_id: str,
        scope_keys: Sequence[str],
        period: str,
        cost_micros: int,
        at_us: int | None = None,
    ) -> bool:
        check_charge(charge_id, scope_keys, period, cost_micros)
        keys = [self._done_key(charge_id)]
        for scope in scope_keys:
            keys += [self._scope_keys(scope)[0], *self._charge_keys(scope, period)]
        at = wall_us() if at_us is None else at_us
        args: list[str | int] = [period, cost_micros, self._settled_ttl_s, at, charge_id]
        return bool(await self._script(self._charge, keys, args))

    async def charged(self, charge_ids: Sequence[str]) -> set[str]:
        if not charge_ids:
            return set()
        done_keys = [self._done_key(cid) for cid in charge_ids]
        values = await self._call(lambda: self._client.mget(done_keys))
        return {cid for cid, value in zip(charge_ids, values, strict=True) if value is not None}

    async def usage(self, scope_key: str, period: str) -> ScopeUsage:
        keys = [self._active, *self._scope_keys(scope_key)]
        counters = await self._script(self._usage, keys, [scope_key, period, self._window_us])
        spent, reserved, concurrent, requests, tokens, now, oldest, newest = map(int, counters)
        reset_s, leaves_s = window_timing(oldest, newest, now, self._window_us)
        return ScopeUsage(spent, reserved, concurrent, requests, tokens, reset_s, leaves_s)

    async def begin_rebuild(self, period: str) -> str:
        token = uuid.uuid4().hex
        key = f"{self._prefix}rebuild:{token}"
        await self._call(lambda: self._client.set(key, period, ex=24 * 3600))
        return token

    async def rebase(self, period: str, cutoff_us: int, bases: Mapping[str, int]) -> None:
        check_rebase(period, cutoff_us, bases)
        items = list(bases.items())
        for start in range(0, len(items), _REBASE_BATCH):
            keys: list[str] = []
            args: list[str | int] = [period, cutoff_us]
            for scope, base in items[start : start + _REBASE_BATCH]:
                keys += [self._scope_keys(scope)[0], *self._charge_keys(scope, period)]
                args.append(base)
            await self._script(self._rebase, keys, args)

    async def finish_rebuild(self, period: str, token: str, hold_s: float) -> bool:
        keys = [f"{self._prefix}rebuild:{token}", self._ready_key(period)]
        return bool(await self._script(self._finish, keys, [int(hold_s * 1e6), token]))

    async def is_ready(self, period: str) -> bool:
        key = self._ready_key(period)
        return bool(await self._call(lambda: self._client.exists(key)))

    async def expire_leases(self) -> int:
        """Sweep: two round trips per batch of due scopes (which scopes, then release)."""
        released = 0
        for _ in range(_SWEEP_MAX_ROUNDS):
            names = await self._script(self._due, [self._active], [_SWEEP_BATCH])
            due = [_text(name) for name in names]
            if not due:
                break
            keys = [self._active]
            for scope in due:
                keys += self._scope_keys(scope)[:3]
            released += int(await self._script(self._expire, keys, list(due)))
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
