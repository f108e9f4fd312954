"""The planner: decides GPUs per datacenter, pipeline stages and their layer
ranges, stage placement, data-parallel degree, microbatches and WAN streams
with an OR-Tools CP-SAT model, judged by the schedule simulator; also the
baselines and the brute-force checker it is tested against, and the plan file
that is the contract with the agents.

May import the core (geosched/ without its CLI) only, and never torch.
"""
