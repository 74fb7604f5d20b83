"""The request bodies of the OpenAI-compatible routes as typed pydantic models: /v1/completions,
/v1/chat/completions, /v1/embeddings, /tokenize, /detokenize.

`CompletionRequest.parse(body, strict)` -> (the request, the names of the fields it ignored). Each field is checked
by its function in checks.py (a PlainValidator: pydantic's own messages differ from the API's, which clients and
tests rely on), in the order the model declares them; the first bad one is refused (APIError 400 naming it). A field
the route does not know is ignored (the server logs it), as vLLM does: clients written for vLLM or OpenAI send
fields such as `metadata`, `store` or `service_tier`. With strict=True (`--strict-fields`) it is refused.
"""

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationInfo, model_validator

from . import checks as c
from .errors import APIError

Prompts = tuple[Literal["text"], list[str]] | tuple[Literal["ids"], list[list[int]]]
Structured = tuple[str, Any] | None     # (grammar kind, its spec), or None: plain text


def _checked(check):
    """The field checked by `check(name, value)`."""
    return PlainValidator(lambda v, info: check(info.field_name, v))


def _opt(check):
    """An optional field (null or absent: None), checked by `check` when given."""
    return _checked(c.optional(check))


PositiveInt = Annotated[int | None, _opt(c.integer(lo=1))]
TopLogprobs = Annotated[int | None, _opt(c.integer(lo=0, hi=c.MAX_TOP_LOGPROBS))]
Bool = Annotated[bool | None, _opt(c.boolean)]
Str = Annotated[str | None, _opt(c.string)]
Penalty = Annotated[float | None, _opt(c.number(-2.0, 2.0))]
Messages = list[dict[str, Any]]
Tools = Annotated[list[dict[str, Any]] | None, _opt(c.tools)]
Ignored = Annotated[Any, _opt(c.ignored)]


class Request(BaseModel):
    """A route's request body. REQUIRED names the field that must be given (not null)."""

    model_config = ConfigDict(extra="ignore")
    REQUIRED: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _known_and_required(cls, body: Any, info: ValidationInfo) -> Any:
        if (info.context or {}).get("strict"):
            unknown = cls.unknown_fields(body)
            if unknown:
                raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                               code="unknown_parameter")
        if cls.REQUIRED is not None and body.get(cls.REQUIRED) is None:
            raise APIError(400, f"Missing required parameter: '{cls.REQUIRED}'.", param=cls.REQUIRED,
                           code="missing_required_parameter")
        return body

    @classmethod
    def unknown_fields(cls, body: dict) -> list[str]:
        return [k for k in body if k not in cls.model_fields]

    @classmethod
    def parse(cls, body: dict, strict: bool = False) -> tuple[Self, list[str]]:
        """body (a JSON object) -> (the checked request, the fields it ignored); APIError 400 on the first bad
        field (strict: on an unknown one too)."""
        return cls.model_validate(body, context={"strict": strict}), cls.unknown_fields(body)


class GenerationRequest(Request):
    """The fields /v1/completions and /v1/chat/completions share: sampling, stops, lengths, structured output."""

    model: Str = None
    max_tokens: PositiveInt = None
    temperature: Annotated[float | None, _opt(c.number(lo=0.0))] = None
    top_p: Annotated[float | None, _opt(c.number(lo=0.0, hi=1.0, lo_open=True))] = None
    top_k: Annotated[int | None, _opt(c.integer(lo=-1))] = None
    seed: Annotated[int | None, _opt(c.integer(lo=0, hi=c.MAX_SEED))] = None
    stop: Annotated[list[str | int] | None, _opt(c.stop)] = None
    stop_token_ids: Annotated[list[int] | None, _opt(c.at_most(c.MAX_STOP_TOKEN_IDS, c.token_ids))] = None
    n: Annotated[int | None, _opt(c.integer(lo=1, hi=c.MAX_SEQS_PER_REQUEST))] = None
    stream: Bool = None
    stream_options: Annotated[dict[str, bool] | None, _opt(c.stream_options)] = None
    return_token_ids: Bool = None
    ignore_eos: Bool = None
    user: Str = None
    cache_salt: Annotated[str | None, _opt(c.cache_salt)] = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: Annotated[float | None, _opt(c.number(0.0, 100.0, lo_open=True))] = None
    min_p: Annotated[float | None, _opt(c.number(0.0, 1.0))] = None
    min_tokens: Annotated[int | None, _opt(c.integer(lo=0))] = None
    logit_bias: Annotated[tuple[tuple[int, float], ...] | None,
                          _opt(c.at_most(c.MAX_LOGIT_BIAS, c.logit_bias))] = None
    add_special_tokens: Bool = None
    prompt_logprobs: TopLogprobs = None
    response_format: Annotated[Structured, _opt(c.response_format)] = None
    structured_outputs: Annotated[Structured, _opt(c.structured_outputs)] = None
    guided_decoding: Annotated[Structured, _opt(c.structured_outputs)] = None
    guided_json: Annotated[dict[str, Any] | None, _opt(c.json_schema)] = None
    guided_regex: Str = None
    guided_choice: Annotated[list[str] | None, _opt(c.choices)] = None
    guided_grammar: Str = None
    guided_decoding_backend: Ignored = None
    guided_whitespace_pattern: Ignored = None
    skip_special_tokens: Bool = None
    priority: Annotated[int | None, _opt(c.integer(*c.INT64))] = None
    return_tokens_as_token_ids: Bool = None


class CompletionRequest(GenerationRequest):
    REQUIRED: ClassVar[str | None] = "prompt"

    prompt: Annotated[Prompts, _checked(c.prompt)]
    echo: Bool = None
    suffix: Annotated[str | None, _opt(c.unsupported(""))] = None
    logprobs: TopLogprobs = None
    best_of: Annotated[int | None, _opt(c.unsupported(1))] = None


class ChatRequest(GenerationRequest):
    REQUIRED: ClassVar[str | None] = "messages"

    messages: Annotated[Messages, _checked(c.messages)]
    max_completion_tokens: PositiveInt = None
    logprobs: Bool = None
    top_logprobs: TopLogprobs = None
    add_generation_prompt: Bool = None
    tools: Tools = None
    tool_choice: Annotated[str | dict[str, str] | None, _opt(c.tool_choice)] = None
    parallel_tool_calls: Bool = None
    chat_template_kwargs: Ignored = None


class EmbeddingRequest(Request):
    REQUIRED: ClassVar[str | None] = "input"

    input: Annotated[Prompts, _checked(c.embedding_input)]
    model: Str = None
    encoding_format: Annotated[Literal["float", "base64"] | None, _opt(c.one_of("float", "base64"))] = None
    dimensions: PositiveInt = None
    user: Str = None


class TokenizeRequest(Request):
    """/tokenize: a prompt, or chat messages (and tools) as the chat template renders them."""

    model: Str = None
    prompt: Str = None
    messages: Annotated[Messages | None, _opt(c.messages)] = None
    tools: Tools = None
    add_special_tokens: Bool = None
    add_generation_prompt: Bool = None
    return_token_strs: Bool = None


class DetokenizeRequest(Request):
    REQUIRED: ClassVar[str | None] = "tokens"

    model: Str = None
    tokens: Annotated[list[int], _checked(c.token_ids)]
