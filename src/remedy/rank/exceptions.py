"""Errors raised inside training processes; all derive from `WorkerError`.

They cross Ray actor boundaries, so each pickles with its message.
"""

from __future__ import annotations

from remedy.protocol.exceptions import RemedyError


class WorkerError(RemedyError):
    """Base class for every error raised inside a training process."""


class ActionError(WorkerError):
    """An action could not be applied; retrying will not help."""


class TransientActionError(ActionError):
    """An action failed for a reason that may pass (I/O, a busy resource); worth a retry."""


class CheckpointError(WorkerError):
    """No usable checkpoint: every candidate was missing or failed its checksum."""


class ChaosConfigError(WorkerError):
    """A chaos file is malformed; the message says where and how."""


class RunAborted(WorkerError):
    """The supervisor or the policy aborted the run; raised out of the training loop."""


class GroupLostError(WorkerError):
    """A collective failed because a peer was lost, and the group could not be re-formed."""


class WaitTimeout(WorkerError):
    """A bounded wait of a rank on its helper thread ran out; the message names it and its bound."""


class GuardConfigError(WorkerError, ValueError):
    """What the Guard was given cannot work; the message names the argument and what to change."""


class UserStateError(ActionError):
    """A user's state object raised in `load_state_dict`; its earlier state was kept."""
