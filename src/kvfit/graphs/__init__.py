"""Piecewise CUDA graphs: prefill and mixed steps replayed from graphs of the model's dense
pieces, captured at token-count buckets, with attention run eagerly between them."""
