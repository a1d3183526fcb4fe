"""``headrace serve``: learn online from served traffic.

An OpenAI-compatible endpoint serves the *incumbent* version; every completion is captured with
its tokens, logprobs and version (``store.py``); rewards come back at ``/v1/feedback``; a batch of
them trains a *candidate* forked from the incumbent (``candidates.py``, ``lanes.py``), which a
gate (``gate.py``) lets publish or rejects; ``versions.jsonl`` (``chain.py``) records every
outcome, so a restart serves the last incumbent and a rollback re-publishes an earlier one.
"""
