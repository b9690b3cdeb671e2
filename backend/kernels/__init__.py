"""Triton kernels for the engine, each beside the torch reference it is tested against.

Nothing here is imported by the engine until a Triton backend is chosen
(`backend.layers.attention.attention_backend`), so `TRITON_INTERPRET=1` set before that
point makes every kernel run in Triton's CPU interpreter (how the tests run them)."""
