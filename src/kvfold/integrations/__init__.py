"""Bridges from kvfold to other evaluation tools (optional extras; nothing here is imported by ``kvfold``).

* :mod:`kvfold.integrations.lm_eval` — kvfold as a model of EleutherAI's lm-evaluation-harness
  (``pip install kvfold[lm-eval]``).
* :mod:`kvfold.integrations.vllm` — saved caches served by vLLM's OpenAI server (``kvfold serve``,
  ``pip install kvfold[vllm]``).
"""
