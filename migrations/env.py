"""Alembic environment: the URL comes from the config that tenants.db builds."""

from alembic import context
from sqlalchemy import engine_from_config, pool

import tenants.adapters
import tenants.admins
import tenants.audit
import tenants.batches
import tenants.billing.models
import tenants.files
import tenants.registry
import tenants.sign_ins  # noqa: F401  (each module registers its tables on Base)
from tenants.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}),
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as connection:
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
