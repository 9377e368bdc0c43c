"""Training backends and the training engine's forward: `torch` (one process), `deepspeed` (ZeRO, many ranks)."""
