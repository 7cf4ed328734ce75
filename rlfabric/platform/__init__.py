"""User face and runtime: Platform, ExperimentSpec, CLI, checkpoints, metrics, actors."""
