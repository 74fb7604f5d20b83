"""OpenAI-style errors of the HTTP server: {"error": {"message", "type", "param", "code"}}, and the engine's
refusals mapped onto them."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ..engine import RequestRefused

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def refusal(e: RequestRefused, prompt_param: str) -> APIError:
    """The engine's refusal as an HTTP error; its message names the cause.

    queue_full is 503 + Retry-After (not now: the same request is queued once fewer wait);
    exceeds_queue is 400 (never: the request alone holds more sequences than may wait);
    exceeds_pool is 400 (never: a sequence would not fit the pool even if it were empty), its advice and code
    those of the pool's kind: a sequence holds KV pages for its length, a state slot whatever its length.
    """
    msg = str(e)
    if e.kind == "queue_full":
        return APIError(503, msg, type="service_unavailable_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if e.kind == "exceeds_pool":
        if e.pool == "state_slots":
            return APIError(400, f"{msg}; this artifact serves no sequence (its state pool is empty)",
                            param=prompt_param, code="exceeds_state_pool")
        return APIError(400, f"{msg}; send a shorter prompt or a lower max_tokens", param=prompt_param,
                        code="exceeds_kv_pool")
    if e.kind == "exceeds_queue":
        return APIError(400, f"{msg}; send fewer sequences (n, or prompts)", param="n", code="invalid_value")
    if e.kind == "too_long":
        return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
    code = {"placeholder_token": "placeholder_token", "out_of_vocabulary": "out_of_vocabulary",
            "empty_prompt": "empty_prompt"}.get(e.kind)
    return APIError(400, msg, param=prompt_param if code else None, code=code)
