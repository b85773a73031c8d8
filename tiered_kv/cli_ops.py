"""Operator commands for a disk tier (inspect, verify, compact, export, import)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_operator_commands"]


def add_operator_commands(sub: Any) -> None:
    """Register the operator subcommands on the ``tiered-kv`` parser's subparsers."""
    return None
