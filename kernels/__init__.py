"""Triton kernels (attention, norm, rope, activation, KV store, GEMV) and their torch references."""
