"""The pipeline: prefill a context, compress it, answer from it; chunked prefill; conversations."""
