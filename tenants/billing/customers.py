"""Which Stripe customer each tenant is billed as. The relay creates one on first export;
an operator may instead link a tenant to a customer that already exists in Stripe."""

from __future__ import annotations

import re

from sqlalchemy import delete, select

from tenants.audit import Audited
from tenants.billing.models import StripeCustomer, StripeCustomerRequest
from tenants.errors import ConflictError, InvalidInputError
from tenants.models import Tenant

_CUSTOMER_ID = re.compile(r"^cus_[A-Za-z0-9]{1,250}$")


class StripeCustomerService(Audited):
    async def find(self, tenant: Tenant) -> str | None:
        return await self.session.scalar(
            select(StripeCustomer.customer_id).where(StripeCustomer.tenant_id == tenant.id)
        )

    async def link(self, tenant: Tenant, customer_id: str) -> None:
        """Bill `tenant` as `customer_id` from the next export on (audited). Usage already
        exported stays with the customer it went to."""
        if not _CUSTOMER_ID.match(customer_id):
            raise InvalidInputError(f"not a Stripe customer id (cus_…): {customer_id!r}")
        owner = await self.session.scalar(
            select(StripeCustomer.tenant_id).where(StripeCustomer.customer_id == customer_id)
        )
        if owner is not None and owner != tenant.id:
            raise ConflictError(f"{customer_id} already bills another tenant")
        mapping = await self.session.get(StripeCustomer, tenant.id)
        previous = None if mapping is None else mapping.customer_id
        if mapping is None:
            self.session.add(StripeCustomer(tenant_id=tenant.id, customer_id=customer_id))
        else:
            mapping.customer_id = customer_id
        # A creation still pending (or refused) is moot now: the relay uses this customer.
        await self.session.execute(
            delete(StripeCustomerRequest).where(StripeCustomerRequest.tenant_id == tenant.id)
        )
        await self.session.flush()
        await self._audit(
            "billing.customer.link",
            f"tenant:{tenant.name}",
            tenant.id,
            customer_id=customer_id,
            previous=previous,
        )
