"""Trainer adapters (TRL, verl, OpenRLHF), each an optional extra imported on its own."""

import sys


def replace_everywhere(source, replacements) -> None:
    """Replace each ``source.<name>`` by ours in every loaded module that holds that same object by name (a
    trainer's modules import its functions by name, so patching ``source`` alone would miss them)."""
    for name, ours in replacements.items():
        original = getattr(source, name)
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, name, None) is original:
                setattr(module, name, ours)
