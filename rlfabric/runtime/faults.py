"""Naming what failed where: an exception out of a Ray call, as one paragraph.

A remote call's exception arrives wrapped (RayTaskError, whose `cause` is the
actor's own exception) or as the actor's death (RayActorError), with the
remote traceback in its text. `name_actor_error` turns either into an
`ActorError` that names the actor: an RLFabricError raised inside an actor
keeps its own message (it already says what to fix), anything else is
"<actor> raised <type>: <message>". The remote traceback goes along for the
log file, not for the user's terminal. Warnings an actor logs are kept
(`capture_warnings`) for the driver to fetch and log under the actor's name.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rlfabric.errors import ActorError, RLFabricError


def name_actor_error(err: BaseException, actor: str) -> ActorError:
    """`err`, raised by a call to `actor` ("the learner", "env runner 2"), as an ActorError.

    An ActorError inside it was named where it arose (a runner passing on its
    learner's failure) and is kept.
    """
    if isinstance(err, RayTaskError):  # first: Ray's wrapper is also an instance of the cause
        cause = err.cause
        if isinstance(cause, ActorError):
            return cause
        if isinstance(cause, RLFabricError):
            return ActorError(str(cause), actor, str(err), user_error=True)
        if isinstance(cause, RayActorError) and not cause.actor_init_failed:
            # An actor it called died (its own ray.get, unnamed): still a death.
            message = f"{actor} lost an actor it called, which died: {death_cause(str(cause))}"
            return ActorError(message, actor, str(err), died=True)
        return ActorError(f"{actor} raised {exception_line(cause)}", actor, str(err))
    if isinstance(err, RayActorError):
        if err.actor_init_failed:  # its constructor raised: an error, not a death
            return ActorError(f"{actor} died: {_last_line(str(err))}", actor, str(err))
        return ActorError(f"{actor} died: {death_cause(str(err))}", actor, str(err), died=True)
    if isinstance(err, ActorError):
        return err
    return ActorError(f"{actor}: {exception_line(err)}", actor)


def exception_line(err: BaseException) -> str:
    """`Type: first line of the message`, as a traceback's last line shows it."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _last_line(text: str) -> str:
    """A dead actor's message ends with its creation error's `Type: message` line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # Ray colours the process title
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    first = re.split(r",? ray::", lines[0])[0].rstrip(" ,")  # then the process title
    return first if len(lines) == 1 or first == lines[-1] else f"{first} ({lines[-1]})"


def death_cause(text: str) -> str:
    """How a dead actor's process ended, as Ray reports it, and where: "SYSTEM_ERROR:
    Worker unexpectedly exits ... (pid 18544, node 127.0.0.1)". Ray's message lists
    the actor's fields one per line, then a paragraph whose advice is left out."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    fields = dict(re.findall(r"^\s*(pid|ip): (\S+)$", text, flags=re.MULTILINE))
    exit_type = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text, re.DOTALL)
    if exit_type:
        cause = exit_type.group(1) + (f": {detail.group(1).strip()}" if detail else "")
    else:
        cause = _last_line(text)
    where = [
        f"{name} {fields[key]}" for key, name in (("pid", "pid"), ("ip", "node")) if key in fields
    ]
    return f"{cause} ({', '.join(where)})" if where else cause


def call(ref: ray.ObjectRef, actor: str, timeout_s: float | None = None) -> Any:
    """`ray.get(ref)`, bounded by `timeout_s`, with a failure named by `actor`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise ActorError(
            f"{actor} did not answer within {timeout_s:g} s (run.actor_timeout_s): it is "
            "blocked, or waiting for a process that died",
            actor,
        ) from None
    except (RayTaskError, RayActorError) as err:
        raise name_actor_error(err, actor) from None


class WarningBuffer(logging.Handler):
    """An actor process's warnings (rlfabric's log records, Python warnings) kept until
    the driver takes them: Ray runs with log_to_driver=False, so they would appear
    nowhere. The driver logs them to run.log and the terminal, naming the actor."""

    def __init__(self, capacity: int = 200) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self.lines: deque[str] = deque(maxlen=capacity)  # the newest, if many

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def take(self) -> list[str]:
        """The warnings since the last call (thread-safe: deque pops are atomic)."""
        taken = []
        while self.lines:
            taken.append(self.lines.popleft())
        return taken


def capture_warnings() -> WarningBuffer:
    """Keep this actor process's warnings for the driver; called first in an actor's
    constructor, so that its own warnings (a GPU fallback) are kept too."""
    buffer = WarningBuffer()
    logging.captureWarnings(True)
    for name in ("rlfabric", "py.warnings"):
        logging.getLogger(name).addHandler(buffer)
    return buffer
