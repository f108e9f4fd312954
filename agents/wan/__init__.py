"""WAN links: one bidirectional tensor link between two stages over K TCP streams (ZeroMQ).

Owns: the link's settings (``config``), its API (``link``: ``WanLink``), the
I/O thread (``io``, with inbound frame handling in ``inbound``), the protocol
bookkeeping with no sockets (``send``, ``recv``), the link's counters
(``metrics``), encrypted links (``handshake``: the session key agreement on
the CURVE keys; ``seal``: AES-256-GCM on every frame; ``zap``: who may complete the ZeroMQ handshake, a
link's or a prefill endpoint's: CURVE keys, a sealed link's PLAIN login) and the codec of
compressed links (``compress``: blockwise int8 or fp8 payloads). May import ``agents.sockets`` and the core
(``geosched.wire``, ``geosched.chunking``, ``geosched.compression``); nothing
else in agents/.
"""
