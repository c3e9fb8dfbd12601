"""Diagnostics: what a merge did to the cache (merge maps, merged entries)."""
