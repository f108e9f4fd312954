"""Tensor parallelism inside a pipeline stage: a stage's blocks split across tp processes.

Owns: ``mesh`` (the stage's 2-D ("dp", "tp") DeviceMesh over its dp x tp
processes, and the gradient average over "dp") and ``shard`` (Megatron-style
sharding of a GPT stage with ``torch.distributed.tensor.parallel``, and the
model-order full weights of a sharded stage) and ``whole`` (a sharded stage
and its optimizer as whole tensors and back, for checkpoints). Imports torch
and the core; nothing else in agents/.
"""
