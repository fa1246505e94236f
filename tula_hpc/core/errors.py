"""The error a stage fails with: its message says why and what to change (stages/runner.py turns it into a line
and an exit status)."""


class StageError(RuntimeError):
    """A stage cannot go on; the message says why and what to change."""
