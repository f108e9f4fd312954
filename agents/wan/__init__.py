"""WAN links: one bidirectional tensor link between two stages over K TCP streams (ZeroMQ).

Owns: the link's settings (``config``), its API (``link``: ``WanLink``), the
I/O thread (``io``, with inbound frame handling in ``inbound``), the protocol
bookkeeping with no sockets (``send``, ``recv``) and the link's counters
(``metrics``). May import ``agents.sockets`` and the core (``geosched.wire``,
``geosched.chunking``); nothing else in agents/.
"""
