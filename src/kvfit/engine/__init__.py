"""The engine: configuration, scheduling, execution and the LLM API."""
