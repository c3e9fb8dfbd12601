"""Compaction: the kept entries are refitted to stand for the whole cache.

``grkv`` (ridge rewrite of kept keys and values) and Attention Matching (:mod:`.attention_matching`:
fitted β and values on reference queries).
"""
