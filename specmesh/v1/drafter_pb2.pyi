from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "drafter", "sync", "prompt_len", "sampling", "budget", "cache_id", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    drafter: str
    sync: _common_pb2.SessionSync
    prompt_len: int
    sampling: _common_pb2.SamplingParams
    budget: int
    cache_id: str
    features: _common_pb2.HiddenFeatures
    def __init__(self, session_id: _Optional[str] = ..., drafter: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., budget: _Optional[int] = ..., cache_id: _Optional[str] = ..., features: _Optional[_Union[_common_pb2.HiddenFeatures, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tree", "held_len", "draft_ms", "server_ms", "source", "ahead")
    TREE_FIELD_NUMBER: _ClassVar[int]
    HELD_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    held_len: int
    draft_ms: float
    server_ms: float
    source: str
    ahead: AheadResult
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., held_len: _Optional[int] = ..., draft_ms: _Optional[float] = ..., server_ms: _Optional[float] = ..., source: _Optional[str] = ..., ahead: _Optional[_Union[AheadResult, _Mapping]] = ...) -> None: ...

class AheadResult(_message.Message):
    __slots__ = ("result", "reason", "ahead_ms", "wasted_tokens", "outcomes", "start_ms", "end_ms")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    WASTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    START_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    result: str
    reason: str
    ahead_ms: float
    wasted_tokens: int
    outcomes: int
    start_ms: float
    end_ms: float
    def __init__(self, result: _Optional[str] = ..., reason: _Optional[str] = ..., ahead_ms: _Optional[float] = ..., wasted_tokens: _Optional[int] = ..., outcomes: _Optional[int] = ..., start_ms: _Optional[float] = ..., end_ms: _Optional[float] = ...) -> None: ...

class ProposeAheadRequest(_message.Message):
    __slots__ = ("session_id", "drafter", "sync", "prompt_len", "sampling", "budget", "cache_id", "tree", "return_first")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    RETURN_FIRST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    drafter: str
    sync: _common_pb2.SessionSync
    prompt_len: int
    sampling: _common_pb2.SamplingParams
    budget: int
    cache_id: str
    tree: _common_pb2.TokenTree
    return_first: bool
    def __init__(self, session_id: _Optional[str] = ..., drafter: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., budget: _Optional[int] = ..., cache_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., return_first: _Optional[bool] = ...) -> None: ...

class ProposeAheadResponse(_message.Message):
    __slots__ = ("held_len", "server_ms", "first_assumed", "first_tree", "first")
    HELD_LEN_FIELD_NUMBER: _ClassVar[int]
    SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ASSUMED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TREE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    held_len: int
    server_ms: float
    first_assumed: _containers.RepeatedScalarFieldContainer[int]
    first_tree: _common_pb2.TokenTree
    first: AheadResult
    def __init__(self, held_len: _Optional[int] = ..., server_ms: _Optional[float] = ..., first_assumed: _Optional[_Iterable[int]] = ..., first_tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., first: _Optional[_Union[AheadResult, _Mapping]] = ...) -> None: ...

class TokenList(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SeedRequest(_message.Message):
    __slots__ = ("cache_id", "texts", "ttl_s", "replace")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    texts: _containers.RepeatedCompositeFieldContainer[TokenList]
    ttl_s: float
    replace: bool
    def __init__(self, cache_id: _Optional[str] = ..., texts: _Optional[_Iterable[_Union[TokenList, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., replace: _Optional[bool] = ...) -> None: ...

class SeedResponse(_message.Message):
    __slots__ = ("texts", "tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: int
    tokens: int
    def __init__(self, texts: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class DrafterReleaseRequest(_message.Message):
    __slots__ = ("session_id", "finished", "sync", "prompt_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    finished: bool
    sync: _common_pb2.SessionSync
    prompt_len: int
    def __init__(self, session_id: _Optional[str] = ..., finished: _Optional[bool] = ..., sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("drafters", "sessions", "session_ids", "max_sessions", "proposals", "vocab_size", "max_tree_nodes", "feature_drafters", "draft_model", "draft_prefill_ms", "draft_token_ms")
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    sessions: int
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    max_sessions: int
    proposals: int
    vocab_size: int
    max_tree_nodes: int
    feature_drafters: _containers.RepeatedCompositeFieldContainer[FeatureDrafter]
    draft_model: str
    draft_prefill_ms: float
    draft_token_ms: float
    def __init__(self, drafters: _Optional[_Iterable[str]] = ..., sessions: _Optional[int] = ..., session_ids: _Optional[_Iterable[str]] = ..., max_sessions: _Optional[int] = ..., proposals: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., feature_drafters: _Optional[_Iterable[_Union[FeatureDrafter, _Mapping]]] = ..., draft_model: _Optional[str] = ..., draft_prefill_ms: _Optional[float] = ..., draft_token_ms: _Optional[float] = ...) -> None: ...

class FeatureDrafter(_message.Message):
    __slots__ = ("drafter", "layers", "dim", "context_window")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    dim: int
    context_window: int
    def __init__(self, drafter: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., dim: _Optional[int] = ..., context_window: _Optional[int] = ...) -> None: ...
