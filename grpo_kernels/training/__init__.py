"""The thin trainer, its command line, the built-in task and the rewards: an application of the loss.

Nothing in the loss imports this package (the loss's modules sit one level up); it imports the
loss like any user would. ``grpo-kernels train`` and ``python -m grpo_kernels train`` run it.
"""
