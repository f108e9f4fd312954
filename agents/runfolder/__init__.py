"""The run folder of a job: ``report.json``, the pictures, ``endpoints.json``, and the prediction they compare with.

Owns: ``report`` (``build_report`` from the ranks' step reports, ``write_run_folder``:
report.json, timeline.png, predicted.png, timelines.png, trace.json, loss.png),
``predict`` (the simulator's timeline of a layout, as rehearsed or as planned),
``messages`` (each WAN message's time against the simulator's, per replica),
``claim`` (``claim_run_dir``: the folder taken, checked and locked; ``clear_previous_run``)
and ``record`` (``RunRecorder``: what ``geosched job start --run-dir`` keeps of
the metrics and statuses the coordinator receives; ``write_endpoints``). Both
``geosched launch`` (:mod:`agents.rehearsal`) and the CLI's coordinator use it.
May import ``agents.stage`` (step reports, measured timelines),
``agents.control`` (status and metrics messages), ``agents.layout``, the planner
and the core.
"""
