"""TLS for geosched's HTTP endpoints: the prefill front end, the metrics endpoints and their clients.

Owns: the server and client contexts (``context``: Python's ``ssl``, TLS 1.2
or newer, certificate and key loaded and checked before anything binds) and a
rehearsal's certificates (``selfsigned``: a throwaway CA and a server
certificate for this machine's loopback names, made by the ``openssl``
command), and the answer to a plain HTTP request that reached an HTTPS port
(``plain``). It sits below every other layer of ``agents/`` and imports only the
standard library and ``geosched.errors``: nothing here is hand-written crypto.
"""
