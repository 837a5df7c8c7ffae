"""Attention backends, each with its metadata builder (torch reference, CPU native, Triton for GPUs)."""
