"""The admin JSON API: the same services as the CLI, behind an admin key."""
