"""One rank's pipeline stage: the schedule interpreter, its links, and the session that wires them.

Owns: ``runtime`` (``StageRuntime``, which executes a lowered schedule with
its collaborators as Protocols), ``transport`` (sends and receives between
stages over WAN links, compressed where the plan says; address books, relay
routes), ``scatter`` (``ScatterGatherTransport``: a tp rank sends its 1/tp slice of each boundary
tensor, the receiving tp ranks all-gather the slices), ``turns`` (``LinkTurns``: a stage's
replicas take turns on a shared WAN link, tickets in the group's store), ``security``
(``LinkSecurity``: the rank's CURVE keys for its links), ``device`` (the CPU or a GPU per rank, and what
NCCL cannot run refused in one line), ``schedule`` (``job_schedule``: the job's
lowered schedule, torch-free for the launcher and the run folder), ``session``
(``RankSession``/``run_rank``: model stage, optimizer, data, links and the DP
group of one rank) and ``report`` (``StepReport``, measured timelines). May
import ``agents.crossdc``, ``agents.dp``, ``agents.tp``, ``agents.wan``, ``agents.wanem``,
``agents.layout`` and the core.
"""
