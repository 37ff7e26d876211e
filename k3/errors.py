"""The base of every error k3 raises on bad input; the CLI turns these into one-line messages."""


class K3Error(ValueError):
    """Bad input: a config, checkpoint, request or argument k3 cannot use. The message says which and why."""
