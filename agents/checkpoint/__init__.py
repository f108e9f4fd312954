"""Checkpoints: every rank writes its stage's shard atomically; a job resumes from the newest complete step.

Owns: the on-disk layout, writer and verification (``store``), loading a
shard or resharding another stage split (``load``) and the optimizer and RNG
state that goes into a shard (``state``). Imports
torch and the core only.
"""
