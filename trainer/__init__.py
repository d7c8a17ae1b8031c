"""Megatron trainer: losses, packing, snapshots, teacher scoring, weight sync (trainer issue)."""
