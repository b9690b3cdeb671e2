"""The engine: requests, KV blocks, scheduler, model runner, step loop and async front."""
