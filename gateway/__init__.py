"""Tollgate's OpenAI-compatible gateway."""
