"""Tensor parallelism: sharding plans, the process group the model calls, worker processes."""
