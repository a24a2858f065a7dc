"""An error response of the OpenAI API: its HTTP status, OpenAI's ``{"error": {...}}`` body and headers, made here or
from a backend's error."""

from __future__ import annotations

import math
from typing import Any

from mooncake.gateway import tenants
from mooncake.gateway.protocol import ErrorInfo, ErrorOffer, ErrorResponse
from mooncake.serving.types import BackendError, Rejected


class ApiError(Exception):
    """An error response: HTTP ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        offer: ErrorOffer | None = None,
    ) -> None:
        super().__init__(message)
        self.offer = offer
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.error_type, param=self.param, code=self.code, offer=self.offer)
        body = ErrorResponse(error=info).model_dump()
        if self.offer is None:
            del body["error"]["offer"]  # OpenAI's own fields only
        return body

    @classmethod
    def from_backend(cls, error: BackendError) -> ApiError:
        """The response for a backend's error; a 429 always says when to retry (whole seconds, at least 1)."""
        headers = {}
        if error.retry_after_s is not None or error.status == 429:
            retry_after = (
                error.retry_after_s if error.retry_after_s is not None and math.isfinite(error.retry_after_s) else 1
            )
            headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        return cls(
            error.status,
            error.message,
            error_type=error.error_type,
            param=error.param,
            code=error.code,
            headers=headers,
            offer=_offer(error),
        )


def _offer(error: BackendError) -> ErrorOffer | None:
    """What a refusal offers instead: a later start, or an SLO class (only one the request's tenant may use)."""
    offer = error.offer if isinstance(error, Rejected) else None
    if offer is None:
        return None
    slo_class = offer.slo_class if tenants.may_use(offer.slo_class) else None
    return ErrorOffer(start_in_s=round(offer.start_in_s, 3), slo_class=slo_class)
