"""k3: Kimi K3, exact and readable, on an ordinary machine."""

__version__ = "0.1.0"
