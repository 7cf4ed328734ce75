"""Errors meant for the user: the CLI prints their message, not a traceback."""


class RLFabricError(Exception):
    """Base of every error whose message alone tells the user what to fix."""


class SpecError(RLFabricError, ValueError):
    """A spec that cannot run: wrong key, type, value or combination."""


class CheckpointError(RLFabricError):
    """A checkpoint or run folder that is missing or cannot be read."""
