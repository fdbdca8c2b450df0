"""How to install what a feature needs: one wording for every message that says so.

Every message about a missing package points at the README's "Installing" section, which says to
install the torch build that fits the machine (CPU or CUDA) first, then gradaccum with its extras.

Example:
    >>> install_hint("cli")
    "install it with: pip install 'gradaccum[cli]' (see the README, section Installing)"
"""

from __future__ import annotations

__all__ = ["INSTALL_SECTION", "TORCH_CPU_COMMAND", "install_hint", "torch_missing_message"]

INSTALL_SECTION = "the README, section Installing"
"""Where the install instructions are."""

TORCH_CPU_COMMAND = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
"""The CPU-only torch install (a plain `pip install torch` may pull a multi-GB CUDA build)."""


def install_hint(extra: str) -> str:
    """The end of a message about a package that the extra `extra` installs.

    Args:
        extra: The name of a gradaccum extra, such as "cli" or "hf".

    Returns:
        "install it with: pip install 'gradaccum[EXTRA]' (see the README, section Installing)".
    """
    return f"install it with: pip install 'gradaccum[{extra}]' (see {INSTALL_SECTION})"


def torch_missing_message() -> str:
    """The one-line message when PyTorch itself is not installed."""
    return (
        "gradaccum needs PyTorch, which is not installed; install the CPU or CUDA build that fits "
        f"this machine first, e.g. {TORCH_CPU_COMMAND} (see {INSTALL_SECTION})"
    )
