"""Billing: the price book, the usage ledger's outbox, reports, rollups and Stripe export."""
