"""The OpenAI-compatible server: FastAPI front end (app, protocol, metrics) over AsyncEngine, which
runs the engine core's step loop behind an EngineClient (a thread here, or Ray replicas)."""
