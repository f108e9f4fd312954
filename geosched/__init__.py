"""geosched: the core (config schema, cost model, schedules and their simulator, model, data, wire
format) and, in ``cli`` and ``commands/``, the command line.

Layers, top to bottom: ``geosched.console`` (the script), ``geosched.cli`` and ``geosched.commands`` (one module
per verb) > ``agents/`` > ``planner/`` > the core, i.e. every other module
here. The core imports nothing from the layers above it; ``costmodel``,
``netcost``, ``hierarchical`` and ``schedule/`` never import torch. The contracts live in pyproject.toml.
"""

__version__ = "0.1.0"
