"""The one-machine rehearsal and its measurements: ``geosched launch`` and ``geosched profile``.

Owns: the launcher (``launch``: embedded broker, WAN emulator, one agent
process per rank, coordinator), the prefill load it offers (``prompt_load``),
calibration of compute and messages on this machine (``calibrate``,
``link_profile``), elastic recovery (``elastic``: re-plan and resume after a
loss, for ``launch --elastic``; ``supervised``: the same for ``job start
--elastic``, whose agents a supervisor restarts); the run folder it writes is :mod:`agents.runfolder`'s. It
is the top of agents/ with the daemon: it may import every other agents package.
"""
