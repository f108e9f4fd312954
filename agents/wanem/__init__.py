"""The WAN emulator: TCP relays that give a loopback link a WAN's bandwidth, latency and losses.

Owns: the per-link relay process and its shaping (``relay``) and the
emulator that starts one relay per link of a plan (``emulator``). Used by
rehearsals, calibration and benchmarks; imports only the core.
"""
