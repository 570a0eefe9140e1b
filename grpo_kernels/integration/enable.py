"""Import this module (verl's ``external_lib``) to register our policy losses and patch verl's log-probs."""

from .verl import patch_logprobs, register

register()
patch_logprobs()
