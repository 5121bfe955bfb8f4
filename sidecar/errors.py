"""Domain errors. Each carries a snake_case `code`; `api/errors.py` maps classes to statuses."""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error a caller can see. `message` says what and how to fix it."""

    code = "error"

    def __init__(self, message: str, **extra):
        super().__init__(message)
        self.message = message
        self.extra = extra


class BadRequest(SidecarError):
    code = "bad_request"


class InvalidKey(BadRequest):
    code = "invalid_key"


class Unauthorized(SidecarError):
    code = "unauthorized"


class Forbidden(SidecarError):
    """The caller may not do this: it has not proved it owns the memory it names, or it
    asked on a connection where the sidecar cannot tell who it is (TCP)."""

    code = "forbidden"


class NotFound(SidecarError):
    code = "not_found"


class NamespaceNotFound(NotFound):
    code = "namespace_not_found"


class BufferNotFound(NotFound):
    code = "buffer_not_found"


class LeaseNotFound(NotFound):
    code = "lease_not_found"


class KeyNotFound(NotFound):
    code = "key_not_found"


class TicketNotFound(NotFound):
    code = "ticket_not_found"


class JobNotFound(NotFound):
    code = "job_not_found"


class Conflict(SidecarError):
    code = "conflict"


class PayloadTooLarge(SidecarError):
    code = "payload_too_large"


class GeometryMismatch(SidecarError):
    code = "geometry_mismatch"


class TooMany(SidecarError):
    """A bound on registrations was reached (buffers per namespace, buffers in total)."""

    code = "too_many_buffers"


class NoRoom(SidecarError):
    code = "no_room"


class PinBound(SidecarError):
    """A pin would hold more of the host pool than its owner's bound (sidecar/controls/core.py)."""

    code = "pin_bound"


class NotReady(SidecarError):
    code = "not_ready"


class TransportUnavailable(SidecarError):
    """The transport cannot work on this node (e.g. cuda_ipc without CUDA)."""

    code = "transport_unavailable"
