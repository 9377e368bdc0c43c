"""Errors a run reports as one line (no traceback) — see `gspo_study.cli`."""


class ConfigError(ValueError):
    """A configuration mistake; the message is one line meant for the user (also `gspo_study.config.ConfigError`)."""


class NonFiniteError(RuntimeError):
    """The policy diverged: too many consecutive non-finite updates, or non-finite logits in a rollout."""


class SweepInterrupted(RuntimeError):
    """A sweep's worker process died; what was done is kept and a rerun resumes (exit status 1)."""


class Terminated(BaseException):
    """SIGTERM (a scheduler's notice before SIGKILL): the run stopped at its next safe point, checkpointed and
    marked KILLED; a rerun resumes (exit status 143). A BaseException, so no `except Exception` swallows it."""
