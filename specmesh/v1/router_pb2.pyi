from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "strategy", "drafter", "max_new_tokens", "sampling", "draft_budget", "raw_prompt", "conversation_id", "reasoning", "thinking_budget", "stop", "resume", "draft_ahead", "prediction", "tools", "tool_choice", "parallel_tool_calls", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    THINKING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    strategy: str
    drafter: str
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    draft_budget: int
    raw_prompt: bool
    conversation_id: str
    reasoning: bool
    thinking_budget: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    resume: ResumeFrom
    draft_ahead: str
    prediction: str
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tool]
    tool_choice: str
    parallel_tool_calls: bool
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., strategy: _Optional[str] = ..., drafter: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft_budget: _Optional[int] = ..., raw_prompt: _Optional[bool] = ..., conversation_id: _Optional[str] = ..., reasoning: _Optional[bool] = ..., thinking_budget: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., resume: _Optional[_Union[ResumeFrom, _Mapping]] = ..., draft_ahead: _Optional[str] = ..., prediction: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("token_ids", "text_chars", "session_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_chars: int
    session_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text_chars: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("text", "token_ids", "stats", "session_id", "tool_calls")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    stats: _common_pb2.GenerationStats
    session_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[_common_pb2.GenerationStats, _Mapping]] = ..., session_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    final: GenerateFinal
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class AnticipateRequest(_message.Message):
    __slots__ = ("conversation_id", "messages", "max_tokens", "next_turns", "wait", "cache_salt")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TURNS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    max_tokens: int
    next_turns: int
    wait: bool
    cache_salt: str
    def __init__(self, conversation_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., next_turns: _Optional[int] = ..., wait: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GetAnticipationRequest(_message.Message):
    __slots__ = ("conversation_id", "cache_salt")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    cache_salt: str
    def __init__(self, conversation_id: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AnticipateResponse(_message.Message):
    __slots__ = ("accepted", "detail", "state", "predicted_turns", "texts", "tokens", "preemptions", "warm")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TURNS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    detail: str
    state: str
    predicted_turns: _containers.RepeatedScalarFieldContainer[str]
    texts: int
    tokens: int
    preemptions: int
    warm: bool
    def __init__(self, accepted: _Optional[bool] = ..., detail: _Optional[str] = ..., state: _Optional[str] = ..., predicted_turns: _Optional[_Iterable[str]] = ..., texts: _Optional[int] = ..., tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., warm: _Optional[bool] = ...) -> None: ...

class ListStrategiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StrategyInfo(_message.Message):
    __slots__ = ("name", "description", "drafters", "available", "default_drafter")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    drafters: _containers.RepeatedScalarFieldContainer[str]
    available: bool
    default_drafter: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., drafters: _Optional[_Iterable[str]] = ..., available: _Optional[bool] = ..., default_drafter: _Optional[str] = ...) -> None: ...

class ListStrategiesResponse(_message.Message):
    __slots__ = ("strategies", "default_strategy", "default_drafter")
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    strategies: _containers.RepeatedCompositeFieldContainer[StrategyInfo]
    default_strategy: str
    default_drafter: str
    def __init__(self, strategies: _Optional[_Iterable[_Union[StrategyInfo, _Mapping]]] = ..., default_strategy: _Optional[str] = ..., default_drafter: _Optional[str] = ...) -> None: ...
