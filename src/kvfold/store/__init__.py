"""Saved caches: the cache-file format, writing and loading."""
