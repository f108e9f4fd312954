"""The per-datacenter agent and everything it runs: the MQTT control plane,
multi-stream ZeroMQ WAN links, intra-datacenter collectives
(torch.distributed), the stage runtime that executes a schedule, the prefill
service, checkpoints, the WAN emulator and the one-machine launcher.
"""
