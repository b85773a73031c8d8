"""TEMPORARY, untracked: stands in for the ops helper's tools/ops_cli.py until the merge."""
from ..cli_ops import add_operator_commands  # noqa: F401
