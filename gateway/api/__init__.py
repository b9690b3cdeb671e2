"""OpenAI-compatible routes and their schemas."""
