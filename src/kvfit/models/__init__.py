"""Model definitions (Qwen3, Llama) and weight loading."""
