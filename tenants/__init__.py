"""The business domain: tenants, plans, API keys and the usage ledger."""
