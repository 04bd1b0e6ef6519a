"""One ``torch.autograd.Function`` per op family, each keeping only compressed tensors for backward."""

from slimact.functional.linear import linear

__all__ = ["linear"]
