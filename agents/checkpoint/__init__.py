"""Checkpoints: every rank writes its stage's shard atomically; a job resumes from the newest complete step.

Owns: the on-disk layout, writer, verification and loading (``store``) and
the optimizer and RNG state that goes into a shard (``state``). Imports
torch and the core only.
"""
