"""geosched core: config schema, cost model, schedules and their simulator,
wire format, reports and the command line.

Everything here is shared by the planner (``planner/``) and the per-datacenter
agents (``agents/``); nothing here opens a socket or starts a process.
"""

__version__ = "0.1.0"
