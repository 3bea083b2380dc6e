"""The OpenAI-compatible server: FastAPI front end (app, protocol, metrics) over AsyncEngine, which
runs the engine core's step loop in its own thread (core_thread)."""
