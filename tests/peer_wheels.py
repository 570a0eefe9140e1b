"""A peer's wheel in ``.cache/wheels`` (``GRPO_KERNELS_WHEELS``), whose code the tests load without installing the
peer: ``scripts/setup.sh`` downloads each (``pip download --no-deps``); a test that finds none tries that download
once, and is told None where the registry cannot be reached (it skips, saying so)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

WHEELS = pathlib.Path(
    os.environ.get("GRPO_KERNELS_WHEELS", pathlib.Path(__file__).resolve().parents[1] / ".cache" / "wheels")
)


def peer_wheel(project: str, version: str) -> pathlib.Path | None:
    """``project==version``'s wheel, downloaded here if it is not yet; None where it cannot be had."""
    pattern = f"{project.replace('-', '_')}-{version}-*.whl"
    found = sorted(WHEELS.glob(pattern))
    if found:
        return found[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"{project}=={version}", "-d"]
    try:
        subprocess.run([*command, str(WHEELS)], check=True, timeout=300, capture_output=True)
    except (subprocess.SubprocessError, OSError):
        return None
    found = sorted(WHEELS.glob(pattern))
    return found[0] if found else None


def missing_wheel(project: str, version: str) -> str:
    """The skip reason of a test whose peer wheel could not be had."""
    return (
        f"{project} {version}'s wheel is not in {WHEELS} and `pip download --no-deps {project}=={version}` could not "
        "fetch it (no registry): its code cannot be run here"
    )
