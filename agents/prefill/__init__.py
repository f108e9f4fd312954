"""Prefill as a service: inference prefill requests served in the pipeline's bubbles.

Owns: the wire protocol (``protocol``), the client (``client``), the
service with admission control and deadlines (``service``), the served
model (``model``) and its counters (``metrics``). May import
``agents.sockets`` and the core; it knows nothing of the stage it fills.
"""
