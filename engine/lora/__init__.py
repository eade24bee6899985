"""Engine-side LoRA serving: device slot pool, host LRU tier, per-step LoRA context."""
