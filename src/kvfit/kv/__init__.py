"""The KV cache on top of vmm: specs and layouts, the extensible cache, sizing policy."""
