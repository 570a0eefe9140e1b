"""grpo-kernels: fused Triton kernels for the GRPO loss, with a PyTorch front end."""

from . import argument_docs as _argument_docs
from .distillation import (
    DistillationOutput,
    FusedLinearTopKDistillationLoss,
    TopKDistillationLoss,
    fused_linear_topk_distillation_loss,
    reverse_kl_advantages,
    reverse_kl_distillation_loss,
    topk_distillation_loss,
    topk_logprobs,
)
from .kept_set import KeptSet
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
from .methods import dpo_loss, reward_model_loss, rft_loss, sft_loss
from .objective import GRPOLossOutput
from .options import GRPOOptions
from .reference import grpo_loss_reference
from .rollout_correction import OpenRLHFCorrection, TRLImportanceSampling, VerlRolloutCorrection

__all__ = [
    "DistillationOutput",
    "FusedLinearGRPOLoss",
    "FusedLinearTopKDistillationLoss",
    "GRPOLoss",
    "GRPOLossOutput",
    "GRPOOptions",
    "KeptSet",
    "OpenRLHFCorrection",
    "TRLImportanceSampling",
    "TopKDistillationLoss",
    "VerlRolloutCorrection",
    "dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_topk_distillation_loss",
    "grpo_loss",
    "grpo_loss_reference",
    "linear_selective_log_softmax",
    "linear_selective_log_softmax_and_entropy",
    "linear_token_logprobs",
    "reverse_kl_advantages",
    "reverse_kl_distillation_loss",
    "reward_model_loss",
    "rft_loss",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
    "topk_distillation_loss",
    "topk_logprobs",
]

# every public argument's description appended to its docstring (the API reference's; argument_docs.py)
_argument_docs.document_public(globals(), __all__)
__version__ = "0.1.0"
