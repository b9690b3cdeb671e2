"""Authenticated keys, remembered for a few seconds so a request need not look its key up.

Every change to a key's standing (revocation, its limits, its tenant's plan) bumps the
key generation, one row, in the change's own transaction (tenants.services.keys_changed),
whichever process makes it: a gateway replica, the console, the CLI. A remembered key is
used only under the generation it was looked up under, so the change takes effect on
every replica as soon as that replica knows the new generation:
- on PostgreSQL, from LISTEN/NOTIFY (gateway.admission.key_generation): the bump notifies
  its value on commit, each gateway's listener keeps it in memory, and no request reads
  it. A change refuses the next request once its notification is in (delivery on
  loopback is well under a millisecond; see bench/README.md), and on the replica that
  committed it, the very next request (it learns its own bump on commit); while the
  listener is blind (its connection lost, not yet re-listened and re-read) every request
  reads the generation as below;
- on SQLite, each request reads the row on a connection of the event loop's own
  (gateway.admission.key_generation.SqliteGeneration: microseconds, never waiting), so a
  change committed anywhere refuses the very next request;
- where that read cannot be made at once, and on PostgreSQL while the listener is blind,
  each request reads the row through the pool: one primary-key read in one round trip
  (autocommit, on a pool with no ping: tenants.db.create_direct_engine), in READ
  COMMITTED, with the same effect.
The few seconds bound only how long an unchanged key goes without its lookup (its
last_used_at, a revoked key's audit).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tenants import keys
from tenants.models import KeyGeneration
from tenants.services import Principal

REMEMBER_S = 5.0
MOST_KEYS = 10_000  # the least recently used are forgotten first

_GENERATION = select(KeyGeneration.value).where(KeyGeneration.id == 1)


async def key_generation(connection: AsyncConnection) -> int | None:
    """The current generation; None where the row is missing (nothing is remembered)."""
    return await connection.scalar(_GENERATION)


async def read_key_generation(reads: AsyncEngine) -> int | None:
    """The current generation through `reads` (tenants.db.create_direct_engine). Its
    connections are not pinged before use, so a dead one (the database restarted) fails
    its read: the pool then drops it and its peers, and the read is tried once more on a
    new connection (a read, safe to repeat)."""
    try:
        async with reads.connect() as connection:
            return await key_generation(connection)
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
    async with reads.connect() as connection:
        return await key_generation(connection)


class KeyCache:
    def __init__(self, remember_s: float = REMEMBER_S, most: int = MOST_KEYS) -> None:
        self.remember_s = remember_s
        self.most = most
        # the key's hash -> (who it is, the generation it was looked up under, until when)
        self._known: OrderedDict[str, tuple[Principal, int, float]] = OrderedDict()

    def get(self, secret: str, generation: int | None) -> Principal | None:
        digest = keys.hash_key(secret)
        known = self._known.get(digest)
        if known is None or generation is None:
            return None
        principal, looked_up_under, until = known
        if looked_up_under != generation or time.monotonic() >= until:
            del self._known[digest]
            return None
        self._known.move_to_end(digest)
        return principal

    def put(self, secret: str, principal: Principal, generation: int | None) -> None:
        """Remember a key looked up under `generation` (read before the lookup began)."""
        if generation is None:
            return
        self._known[keys.hash_key(secret)] = (
            principal,
            generation,
            time.monotonic() + self.remember_s,
        )
        while len(self._known) > self.most:
            self._known.popitem(last=False)
