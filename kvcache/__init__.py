"""Paged KV cache: pure-Python block accounting (allocator, manager) and, for
the worker only, the device/host tensors (cache_engine)."""
