"""Errors a run reports as one line (no traceback) — see `gspo_study.cli`."""


class NonFiniteError(RuntimeError):
    """The policy diverged: too many consecutive non-finite updates, or non-finite logits in a rollout."""
