"""The selector's one error: a value it cannot use, named as the option that gave it (--budget, --sample, ...).

The selector knows nothing of fanstore; fanstore, its caller, reports this as its own one-line usage error."""

from __future__ import annotations


class SelectionError(ValueError):
    """An argument of the selection has a value the selector cannot use; the message names the option."""
