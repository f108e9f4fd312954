"""The MQTT control plane: messages, the client every agent and the coordinator use, the embedded broker.

Owns: the message schema and topics (``messages``), the broker address
(``address``), the signed envelope that lets agents obey only the
coordinator and trust a rank's status only from its agent (``auth``), by
rank why a status was not believed (``refused``), the
asyncio client with reconnects and subscriptions (``plane``,
``subscription``), the embedded MQTT broker (``broker``, with its packet
codec in ``mqtt_codec`` and its logins, ACLs and bounds in
``broker_policy``), the endpoints agents exchange in their statuses
(``endpoints``) and the coordinator that starts, watches and stops a job
(``coordinator``). May import ``agents.layout`` and the core; nothing that
trains (no torch).
"""
