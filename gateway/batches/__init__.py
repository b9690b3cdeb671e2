"""The Batch API's application services: creating a batch (its checks and its worst case)
and running its lines in the gateway's background (tenants.batches keeps their state)."""
