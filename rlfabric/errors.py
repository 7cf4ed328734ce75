"""Errors meant for the user: the CLI prints their message, not a traceback."""


class RLFabricError(Exception):
    """Base of every error whose message alone tells the user what to fix."""


class SpecError(RLFabricError, ValueError):
    """A spec that cannot run: wrong key, type, value or combination."""


class CheckpointError(RLFabricError):
    """A checkpoint or run folder that is missing or cannot be read."""


class ActorError(RLFabricError):
    """An exception raised inside a Ray actor, named by the actor it came from.

    Its message is one paragraph for the user; `remote_traceback` keeps the
    actor's traceback for the log file. `user_error` says the actor raised an
    RLFabricError (its message alone says what to fix), whose message is kept as is.
    `died` says the actor's process died (killed, out of memory, its node lost), as
    opposed to raising: a death can be mended by starting it again, an exception not.
    """

    def __init__(
        self,
        message: str,
        actor: str,
        remote_traceback: str = "",
        user_error: bool = False,
        died: bool = False,
    ) -> None:
        super().__init__(message)
        self.actor = actor
        self.remote_traceback = remote_traceback
        self.user_error = user_error
        self.died = died

    def __reduce__(self) -> tuple[type, tuple[str, str, str, bool, bool]]:
        # Crosses Ray's object store inside a runner's error: pickle every field.
        fields = (str(self), self.actor, self.remote_traceback, self.user_error, self.died)
        return (type(self), fields)
