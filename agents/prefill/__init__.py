"""Prefill as a service: inference prefill requests served in the pipeline's bubbles.

Owns: the wire protocol (``protocol``), the client (``client``), the service with admission control and
deadlines (``service``), a request as it is computed, chunk by chunk and block by block (``jobs``), the served
model (``model``) and swapping it between requests (``swap``), its counters (``metrics``) and the OpenAI-style
HTTP front end on the same service (``http``, its bodies in ``completions``, its bounds in ``connections``) with
its client (``http_client``).
May import ``agents.sockets`` and the core; it knows nothing of the stage it fills.
"""
