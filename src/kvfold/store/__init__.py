"""Saved caches: the cache-file format (``format``), writing (``save``), loading (``load``) and saved
conversations (``chat``)."""
