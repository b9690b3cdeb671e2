"""Console administrators (owner or viewer) and their server-side sign-in sessions.

Passwords are hashed with scrypt (memory-hard, in the standard library) at OWASP's minimum
cost; a hash stored at another cost is redone at its owner's next sign-in. A session is a
random token in an HttpOnly cookie; only its SHA-256 is stored, so a copy of the database
cannot sign anyone in. Sessions end on logout or after an idle period.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import DateTime, ForeignKey, String, delete, func, select
from sqlalchemy.orm import Mapped, mapped_column

from tenants.audit import Audited
from tenants.errors import ConflictError, InvalidInputError, found
from tenants.keys import hash_key
from tenants.models import Base, as_utc, new_id, utcnow

T = TypeVar("T")
MIN_PASSWORD_LENGTH = 12
# Touch a session's last_seen_at at most this often: one write a minute, not one a page.
SEEN_GRANULARITY = timedelta(seconds=30)
# No whitespace or control characters (PostgreSQL text cannot hold NUL at all).
_EMAIL = re.compile(r"^[^@\s\x00-\x1f\x7f]+@[^@\s\x00-\x1f\x7f]+$")


@dataclass(frozen=True)
class ScryptCost:
    n: int  # CPU and memory cost: 128 * n * r bytes
    r: int
    p: int


# OWASP's minimum for scrypt (Password Storage Cheat Sheet): 128 MiB, ~0.3 s a hash.
OWASP_COST = ScryptCost(n=2**17, r=8, p=1)
_MAXMEM = 256 * 2**20  # room for OWASP_COST; a stored hash asking for more never verifies
_cost = OWASP_COST
# Each running scrypt holds its 128 MiB. Two threads of its own run it: a flood of sign-ins
# then queues there, and neither exhausts memory nor takes the default executor's threads
# (which other work, such as tokenizing, runs on).
_HASHER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scrypt")
# Checked when the email is unknown, so the work does not reveal which emails exist.
_DUMMY_SALT, _DUMMY_DIGEST = secrets.token_bytes(16), secrets.token_bytes(32)


@contextlib.contextmanager
def scrypt_cost_for_tests(cost: ScryptCost) -> Iterator[None]:
    """Tests only: hash new passwords at `cost` instead of OWASP_COST within the block, so
    a suite that creates hundreds of administrators stays fast. The gateway never calls it."""
    global _cost
    saved, _cost = _cost, cost
    try:
        yield
    finally:
        _cost = saved


class AdminRole(enum.StrEnum):
    OWNER = "owner"  # everything
    VIEWER = "viewer"  # read-only


class ConsoleAdmin(Base):
    __tablename__ = "console_admins"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    email: Mapped[str] = mapped_column(String(254), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    password_hash: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_login_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    @property
    def can_write(self) -> bool:
        return self.role == AdminRole.OWNER


class ConsoleSession(Base):
    __tablename__ = "console_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    admin_id: Mapped[str] = mapped_column(
        ForeignKey("console_admins.id", ondelete="CASCADE"), index=True
    )
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True),
        default=utcnow,
        index=True,  # idle sweeps
    )


@dataclass(frozen=True)
class SignedIn:
    """A live session: who, and the session row (for its CSRF token)."""

    admin: ConsoleAdmin
    session: ConsoleSession


def hash_password(password: str) -> str:
    cost, salt = _cost, secrets.token_bytes(16)
    return _format(cost, salt, _scrypt(password, salt, cost))


def verify_password(password: str, stored: str) -> bool:
    """Whether `password` is the one `stored` was made from, at whatever cost it names."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        actual = _scrypt(password, _unb64(salt), ScryptCost(int(n), int(r), int(p)))
    except ValueError:
        return False
    return hmac.compare_digest(actual, _unb64(digest))


def needs_rehash(stored: str) -> bool:
    """Made at another cost than today's (an older, cheaper one): hash it again."""
    return stored.split("$")[:4] != ["scrypt", str(_cost.n), str(_cost.r), str(_cost.p)]


def _format(cost: ScryptCost, salt: bytes, digest: bytes) -> str:
    return "$".join(["scrypt", str(cost.n), str(cost.r), str(cost.p), _b64(salt), _b64(digest)])


def _dummy_hash() -> str:
    return _format(_cost, _DUMMY_SALT, _DUMMY_DIGEST)


def _scrypt(password: str, salt: bytes, cost: ScryptCost) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=cost.n, r=cost.r, p=cost.p, maxmem=_MAXMEM, dklen=32
    )


async def _hashing(work: Callable[..., T], *args: str) -> T:
    """`work` (slow on purpose) on the scrypt threads, never on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_HASHER, work, *args)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


class AdminService(Audited):
    """Console administrators; `actor` is who creates them, for the audit log."""

    async def create(self, email: str, role: str, password: str) -> ConsoleAdmin:
        email = email.strip().lower()
        if not _EMAIL.match(email) or len(email) > 254:
            raise InvalidInputError(f"not an email address: {email!r}")
        if role not in set(AdminRole):
            raise InvalidInputError("role must be 'owner' or 'viewer'")
        if len(password) < MIN_PASSWORD_LENGTH:
            raise InvalidInputError(f"password must be at least {MIN_PASSWORD_LENGTH} characters")
        if await self.find(email) is not None:
            raise ConflictError(f"administrator {email!r} already exists")
        hashed = await _hashing(hash_password, password)
        admin = ConsoleAdmin(email=email, role=role, password_hash=hashed)
        self.session.add(admin)
        await self.session.flush()
        await self._audit("console_admin.create", f"admin:{email}", None, role=role)
        return admin

    async def find(self, email: str) -> ConsoleAdmin | None:
        email = email.strip().lower()
        if not _EMAIL.match(email) or len(email) > 254:
            return None  # no stored administrator has such an address
        return await self.session.scalar(select(ConsoleAdmin).where(ConsoleAdmin.email == email))

    async def get(self, email: str) -> ConsoleAdmin:
        return found(await self.find(email), f"no administrator {email!r}")

    async def list(self) -> list[ConsoleAdmin]:
        result = await self.session.execute(select(ConsoleAdmin).order_by(ConsoleAdmin.email))
        return list(result.scalars())

    async def count(self) -> int:
        return int(await self.session.scalar(select(func.count()).select_from(ConsoleAdmin)) or 0)

    async def verify(self, email: str, password: str) -> ConsoleAdmin | None:
        """The administrator if the password is right; None for a wrong email or password.
        scrypt runs on its own threads: it is slow on purpose, and must not stall the event loop."""
        admin = await self.find(email)
        stored = _dummy_hash() if admin is None else admin.password_hash
        if not await _hashing(verify_password, password, stored) or admin is None:
            return None
        if needs_rehash(admin.password_hash):  # saved with the sign-in's transaction
            admin.password_hash = await _hashing(hash_password, password)
        return admin

    async def sign_in(self, admin: ConsoleAdmin, now: datetime | None = None) -> str:
        """Open a session; returns its token (the cookie value), never stored as such."""
        now = now or utcnow()
        token = secrets.token_urlsafe(32)
        self.session.add(
            ConsoleSession(
                token_hash=hash_key(token),
                admin_id=admin.id,
                csrf_token=secrets.token_urlsafe(32),
                created_at=now,
                last_seen_at=now,
            )
        )
        admin.last_login_at = now
        await self.session.flush()
        return token

    async def resume(
        self, token: str, idle: timedelta, now: datetime | None = None
    ) -> SignedIn | None:
        """The session behind `token` if it has been used within `idle`; an idle one ends."""
        now = now or utcnow()
        row = (
            await self.session.execute(
                select(ConsoleSession, ConsoleAdmin)
                .join(ConsoleAdmin, ConsoleAdmin.id == ConsoleSession.admin_id)
                .where(ConsoleSession.token_hash == hash_key(token))
            )
        ).one_or_none()
        if row is None:
            return None
        session, admin = row
        last_seen = as_utc(session.last_seen_at)
        if now - last_seen > idle:
            await self.session.delete(session)
            return None
        if now - last_seen >= SEEN_GRANULARITY:
            session.last_seen_at = now
        return SignedIn(admin=admin, session=session)

    async def sign_out(self, token: str) -> None:
        await self.session.execute(
            delete(ConsoleSession).where(ConsoleSession.token_hash == hash_key(token))
        )

    async def purge_idle(self, idle: timedelta, now: datetime | None = None) -> int:
        """Delete sessions idle for longer than `idle`; returns how many."""
        cutoff = (now or utcnow()) - idle
        result = await self.session.execute(
            delete(ConsoleSession).where(ConsoleSession.last_seen_at < cutoff)
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]
