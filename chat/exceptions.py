"""Every exception the chat app raises on purpose, under one base class.

`ThinkError` is what a host catches to handle "the chat app refused or could not do it" in one place;
each class also keeps the built-in base its callers have always caught (ValueError, LookupError,
TimeoutError). No Django here: the wire codec raises these too.
"""

from __future__ import annotations


class ThinkError(Exception):
    """Base of the chat app's exceptions."""


# -- the wire ---------------------------------------------------------------------------------------------
class ProtocolError(ThinkError, ValueError):
    """A client frame that cannot be accepted; the message says why."""


class LimitExceeded(ProtocolError):
    """A well-formed client frame that is over one of the size limits."""


class AnswerRefused(LimitExceeded):
    """A tool result over a size limit: the client hears of it for its call (cf_agent_tool_refused)."""

    def __init__(self, message: str, *, tool_call_id: str) -> None:
        super().__init__(message)
        self.tool_call_id = tool_call_id


class AccessDenied(ThinkError):
    """The principal may not use the conversation, or there is no valid principal at all."""


# -- agents and conversations -----------------------------------------------------------------------------
class UnknownAgent(ThinkError, LookupError):
    """No agent of that name in THINK["AGENTS"]."""


class ConversationBusy(ThinkError, TimeoutError):
    """Another turn kept the conversation busy past the timeout; nothing was written."""


class SubmissionConflict(ThinkError, ValueError):
    """The submission id and the idempotency key name two different submissions."""


class SubmissionNotFound(ThinkError, LookupError):
    """No submission with that id in the conversation."""


# -- tools ----------------------------------------------------------------------------------------------
class ToolError(ThinkError):
    """Raised by a server tool to tell the model why it failed: its text is the tool's output error, as
    it is. Any other exception of a tool gives the model and the client only a generic text with a fault
    id (`chat.turn.faults`)."""


# -- the model --------------------------------------------------------------------------------------------
class BranchNotFound(ThinkError, LookupError):
    """No such alternative after that message, or the message is not on the branch in use."""


class StreamStalled(ThinkError):
    """The model stream was silent for longer than the stall timeout."""

    def __init__(self, timeout_ms: int) -> None:
        super().__init__(
            f"Chat stream stalled: no activity for {timeout_ms}ms;"
            " the turn was aborted by the stall watchdog."
        )
        self.timeout_ms = timeout_ms


class ReattachUnavailable(ThinkError):
    """The provider cannot resume that generation: `reason` "not_found" (it expired, was never stored,
    or is unknown) or "unavailable" (the provider refused or failed the resume request)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ResponseFailed(ThinkError):
    """The provider reported the generation failed (a `response.failed` or `error` event); `code` is
    its error code ("server_error", "rate_limit_exceeded", ...) when it gave one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class ConversationLimit(ThinkError):
    """A principal who owns THINK["PRINCIPAL_MAX_CONVERSATIONS"] conversations asked for a new one."""


class ToolCallNotWaiting(ThinkError, LookupError):
    """An approval or a denial from code for a tool call that is not waiting for one: no such call, a
    call that asks for no approval, or one already decided the other way (`AgentHandle.approve`)."""


class ToolSchemaError(ThinkError, TypeError):
    """A tool function's signature cannot become a JSON Schema (its Tool's `schema_error`, reported by
    `manage.py check` as think_chat.E029)."""


class FileRefused(ProtocolError):
    """A file a client sent or uploaded that is not accepted (its type, size, bytes, or a limit of its
    owner); `status` is the HTTP status an upload is refused with (413, 415, 429 or 400)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
