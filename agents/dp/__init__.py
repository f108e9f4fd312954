"""Data parallelism inside a datacenter: a stage's replicas sync gradients with torch.distributed.

Owns: the group's description and backend choice (``spec``), the joined
group with DDP, bucketed all-reduce and failure reports (``group``), the
heartbeats that name a dead rank (``health``), the store rank 0 hosts, on one
address (``store``), the seeds' hand-written ring all-reduce (``ring``), a helper that runs a group in local processes
(``local_group``) and a stage's optimizer sharded over the group, ZeRO 1 and 2
(``zero``). Imports torch and the core; nothing else in agents/.
"""
