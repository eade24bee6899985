"""The CUDA serving path: Triton attention backend, CUDA runner with decode graphs, device weights."""
