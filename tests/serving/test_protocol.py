"""The request models of the HTTP server (serve/openai/protocol.py): every field refuses a bad value with the API's own
error (an APIError 400 naming the field), never with pydantic's ValidationError; the fields are checked in the order
the model declares them; unknown fields are returned as ignored, or refused with strict. The messages themselves are
pinned by tests/test_http*.py and tests/serving/test_openai_parity.py over HTTP. Control: a model with a field typed the
plain pydantic way fails the first check."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tlaloc_jax.serve.openai.errors import APIError
from tlaloc_jax.serve.openai import protocol as p

MODELS = [p.CompletionRequest, p.ChatRequest, p.EmbeddingRequest, p.TokenizeRequest, p.DetokenizeRequest]
JUNK = [{"x": [1]}, [[["deep"]]], "text", 1.5, -7, True, [None]]
VALID_REQUIRED = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "input": "hi", "tokens": [1]}


def field_problems(model: type[p.Request]) -> list[str]:
    """The fields of `model` that let a junk value through to pydantic's own error."""
    base = {model.REQUIRED: VALID_REQUIRED[model.REQUIRED]} if model.REQUIRED else {}
    out = []
    for name in model.model_fields:
        for junk in JUNK:
            try:
                model.parse({**base, name: junk})
            except APIError as e:
                assert e.status == 400 and (e.param or "").startswith(name), (model.__name__, name, e.param)
            except ValidationError:
                out.append(name)
                break
    return out


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_refuses_with_the_api_error(model):
    assert field_problems(model) == []


def test_control_a_plain_pydantic_field_is_found():
    class Plain(p.Request):
        max_tokens: int | None = None
    assert field_problems(Plain) == ["max_tokens"]


def test_fields_checked_in_declared_order_and_unknown_ones_ignored_or_refused():
    with pytest.raises(APIError) as e:
        p.CompletionRequest.parse({"prompt": "hi", "best_of": 2, "max_tokens": 0})
    assert e.value.param == "max_tokens"         # declared before best_of
    req, ignored = p.CompletionRequest.parse({"prompt": "hi", "store": True, "metadata": {}})
    assert ignored == ["store", "metadata"] and req.prompt == ("text", ["hi"]) and req.max_tokens is None
    with pytest.raises(APIError) as e:
        p.CompletionRequest.parse({"store": True}, strict=True)       # before the missing prompt
    assert (e.value.code, e.value.param) == ("unknown_parameter", "store")
    with pytest.raises(APIError) as e:
        p.ChatRequest.parse({"messages": None})
    assert (e.value.code, e.value.param) == ("missing_required_parameter", "messages")
