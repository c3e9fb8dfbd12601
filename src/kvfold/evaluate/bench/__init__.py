"""Benchmarks: speed and memory of the methods (``kvfold bench``) and of saved caches and chat."""
