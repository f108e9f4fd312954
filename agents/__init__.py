"""The agents: everything that runs a plan on real machines.

Layers, top to bottom (enforced by the import contracts in pyproject.toml;
nothing imports upward, not even lazily):

- ``rehearsal`` (the one-machine launcher, calibration) and
  ``daemon`` (``geosched agent``: one asyncio process per rank);
- ``worker``: the daemon's training thread (stage + checkpoints + prefill), and
  ``runfolder``: a job's run folder (report.json, pictures, endpoints.json) for
  ``geosched launch`` and ``geosched job start --run-dir``;
- ``stage``, ``control``, ``prefill``, ``checkpoint``: independent of each other;
- ``crossdc``: data parallelism across DCs (the gradient all-reduce's WAN part, over ``dp`` and ``wan``);
- ``dp``, ``wan``, ``wanem``, ``tp``: independent of each other;
- ``keys``: a job's key folder (signing keys, CURVE keys, prefill token, MQTT
  passwords), written by ``geosched keys`` and read by agents and the coordinator;
- ``layout`` (plan, roles, endpoint names; torch-free), ``sockets`` (the
  one ZeroMQ socket factory), ``metrics`` (the Prometheus metrics and
  their HTTP endpoint) and ``tls`` (the HTTP endpoints' TLS contexts and a
  rehearsal's certificate), which every layer may import.

agents/ may import planner/ and the core (geosched/ without its CLI), never
geosched.cli or geosched.commands.
"""
