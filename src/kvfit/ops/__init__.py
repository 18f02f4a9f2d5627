"""Attention and cache-write kernels: Triton on the GPU, a torch reference on the CPU."""
