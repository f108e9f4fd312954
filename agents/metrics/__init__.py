"""Prometheus metrics of the agents and the coordinator, and the HTTP endpoint that serves them.

Owns: every metric's name, help text, type and buckets (``families``: the
agent's :class:`~agents.metrics.families.AgentMetrics`, the coordinator's
:class:`~agents.metrics.families.JobMetrics`, and the ``/health`` verdicts)
and the server (``server``: ``/metrics`` and ``/health`` of a dedicated
registry, over HTTP). It sits in the lowest layer with
``layout`` and ``sockets`` and imports only ``prometheus_client``, the
standard library and ``geosched.errors``: the daemon, the worker and the
coordinator feed it plain values and snapshot callables, so nothing here
knows a link, a service or a control plane.
"""
