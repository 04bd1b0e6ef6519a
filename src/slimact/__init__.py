"""slimact: train Transformers with a fraction of the activation memory.

``convert`` turns a model's layers into ones that keep compressed tensors for the backward pass,
``profile`` measures what autograd keeps, ``revert`` undoes the conversion, ``state_dict`` /
``load_state_dict`` carry slimact's own state (running estimates, step count) with a checkpoint. Importing slimact never
initialises CUDA and does not import Triton or transformers.
"""

from slimact.check import CheckReport, check
from slimact.convert import Summary, convert, revert, summary
from slimact.policy import PRESETS, KindSettings, Policy, PolicyError
from slimact.profile import Live, Report, profile
from slimact.state import load_state_dict, state_dict

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CheckReport",
    "KindSettings",
    "Live",
    "Policy",
    "PolicyError",
    "Report",
    "Summary",
    "__version__",
    "check",
    "convert",
    "load_state_dict",
    "profile",
    "revert",
    "state_dict",
    "summary",
]
