"""Triton kernels for the CUDA path, each beside a plain-PyTorch reference of the same signature."""
