"""Data parallelism across datacenters: a stage's gradients averaged in its DCs, then over the WAN, then back.

Owns: the WanLinks of a rank to its lane partners in the neighbouring DCs of
its stage's chain (``links``: ``SyncLinks``) and the gradient sync that runs
the hierarchical all-reduce of :mod:`geosched.hierarchical` over them and the
in-DC gloo/NCCL group (``sync``: ``CrossDcSync``, the ``ALL_REDUCE`` of such
a stage). The algorithm itself (lanes, chain, message order, summation order)
is data in :mod:`geosched.hierarchical`; this package only moves bytes. May
import ``agents.dp``, ``agents.wan``, ``agents.layout``, ``agents.sockets``
and the core; ``agents.stage`` imports it.
"""
