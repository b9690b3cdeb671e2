"""How the gateway reaches an engine: the EngineClient seam and its implementations."""
