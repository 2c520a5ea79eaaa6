"""Every exception the recovery app raises on purpose, under one base class."""

from __future__ import annotations


class RecoveryError(Exception):
    """Base of the recovery app's exceptions."""


class LeaseLost(RecoveryError):
    """The fiber is no longer ours: another worker, a recovery or a clear took it over."""


class OperationRefused(RecoveryError):
    """The operation does not apply: an unknown id, a finished fiber, an incident that is not open."""
