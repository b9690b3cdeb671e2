"""HTTP routes for usage and billing: /v1/usage for tenants, /admin/api billing for admins."""
