"""The async engine front end and the OpenAI-compatible HTTP server.

Nothing here is imported by the engine, and this package imports FastAPI only in the modules
that need it (`openai_api`, `metrics`), so `kvfit` runs without the `server` extra.
"""
