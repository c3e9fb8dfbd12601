"""Seconds a check of a small file takes in kvfold serve's catalog (the first check loads the model and
hashes the tokenizer's vocabulary; the later ones show what a check of a replaced file costs).
Usage: OMP_NUM_THREADS=1 .venv-vllm/bin/python check_time.py CACHE_DIR NAME"""
import sys
import time

from kvfold.integrations.vllm.requests import CacheCatalog

catalog = CacheCatalog(sys.argv[1], "smollm2-135m")
catalog._load()  # noqa: SLF001 - the model, once, outside the timing
for _ in range(4):
    start = time.perf_counter()
    catalog._check(sys.argv[2], catalog.directory / f"{sys.argv[2]}.kvc")  # noqa: SLF001
    print(f"check {time.perf_counter() - start:.3f} s")
