"""The user's face (top layer): Platform, ExperimentSpec, CLI, bench, evaluate, export,
reporting, checkpoints.

It composes the lower layers' config sections into one spec, reads the
architecture and algorithm registries, starts Ray and drives a run. Nothing
below imports it: architectures/ -> runtime/ -> algorithms/, models/, envs/,
sparse/.
"""
