"""Checkpoints: every rank writes its stage's shard atomically; a job resumes from the newest complete step.

Owns: the on-disk layout, writer and verification (``store``), loading a
shard or resharding another stage split (``load``), the optimizer and RNG
state that goes into a shard (``state``), whole-model weights merged from a
step's shards (``export``: ``geosched export``, what prefill serves) and
following a folder as new steps complete (``follow``). Imports torch and the
core only.
"""
