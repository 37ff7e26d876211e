"""Numerical operators. Ops know nothing of the model."""
