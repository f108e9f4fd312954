"""The MQTT control plane: messages, the client every agent and the coordinator use, the embedded broker.

Owns: the message schema and topics (``messages``), the broker address
(``address``), the asyncio client with reconnects and subscriptions
(``plane``, ``subscription``), the embedded MQTT broker of rehearsals
(``broker``) and the coordinator that starts, watches and stops a job
(``coordinator``). May import ``agents.layout`` and the core; nothing that
trains (no torch).
"""
