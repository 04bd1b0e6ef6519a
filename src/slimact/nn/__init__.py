"""Drop-in modules: each subclasses the torch module it replaces and keeps compressed tensors for backward."""

from slimact.nn._base import SlimModule
from slimact.nn.linear import Linear

__all__ = ["Linear", "SlimModule"]
