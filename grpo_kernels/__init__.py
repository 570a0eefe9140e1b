"""grpo-kernels: fused Triton kernels for the GRPO loss, with a PyTorch front end."""

from .loss import (
    FusedLinearGRPOLoss,
    GRPOLoss,
    fused_linear_grpo_loss,
    grpo_loss,
    linear_selective_log_softmax,
    linear_selective_log_softmax_and_entropy,
    linear_token_logprobs,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_entropy,
    token_logprobs,
)
from .objective import GRPOLossOutput
from .options import GRPOOptions
from .reference import grpo_loss_reference
from .rollout_correction import OpenRLHFCorrection, TRLImportanceSampling, VerlRolloutCorrection

__all__ = [
    "FusedLinearGRPOLoss",
    "GRPOLoss",
    "GRPOLossOutput",
    "GRPOOptions",
    "OpenRLHFCorrection",
    "TRLImportanceSampling",
    "VerlRolloutCorrection",
    "fused_linear_grpo_loss",
    "grpo_loss",
    "grpo_loss_reference",
    "linear_selective_log_softmax",
    "linear_selective_log_softmax_and_entropy",
    "linear_token_logprobs",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "token_entropy",
    "token_logprobs",
]
__version__ = "0.1.0"
