from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelfDraft(_message.Message):
    __slots__ = ("method", "budget")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    method: str
    budget: int
    def __init__(self, method: _Optional[str] = ..., budget: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "fork_from", "fork_len", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    FORK_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    fork_from: str
    fork_len: int
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., fork_from: _Optional[str] = ..., fork_len: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cache_len",)
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    cache_len: int
    def __init__(self, cache_len: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "sync", "tree", "sampling", "round_seed", "self_draft", "want_entropy", "feature_layers", "prompt_len", "jump_forward", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_SEED_FIELD_NUMBER: _ClassVar[int]
    SELF_DRAFT_FIELD_NUMBER: _ClassVar[int]
    WANT_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    JUMP_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SessionSync
    tree: _common_pb2.TokenTree
    sampling: _common_pb2.SamplingParams
    round_seed: int
    self_draft: SelfDraft
    want_entropy: bool
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    jump_forward: bool
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., round_seed: _Optional[int] = ..., self_draft: _Optional[_Union[SelfDraft, _Mapping]] = ..., want_entropy: _Optional[bool] = ..., feature_layers: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., jump_forward: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "sync", "sampling", "max_steps", "stop_ids", "want_entropy", "self_draft", "tokens_left", "prompt_len", "jump_forward", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SELF_DRAFT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    JUMP_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SessionSync
    sampling: _common_pb2.SamplingParams
    max_steps: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    want_entropy: bool
    self_draft: SelfDraft
    tokens_left: int
    prompt_len: int
    jump_forward: bool
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SessionSync, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_steps: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., want_entropy: _Optional[bool] = ..., self_draft: _Optional[_Union[SelfDraft, _Mapping]] = ..., tokens_left: _Optional[int] = ..., prompt_len: _Optional[int] = ..., jump_forward: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "drafted", "tree_size", "accepted_nodes", "entropy", "draft_ms", "verify_ms", "cache_len", "batch_size", "server_ms", "features", "batch_rows", "logprobs", "forced", "cached_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    drafted: int
    tree_size: int
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    entropy: float
    draft_ms: float
    verify_ms: float
    cache_len: int
    batch_size: int
    server_ms: float
    features: _common_pb2.HiddenFeatures
    batch_rows: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    forced: int
    cached_tokens: int
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., drafted: _Optional[int] = ..., tree_size: _Optional[int] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., entropy: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., cache_len: _Optional[int] = ..., batch_size: _Optional[int] = ..., server_ms: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.HiddenFeatures, _Mapping]] = ..., batch_rows: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., forced: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class VerifierReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model", "dtype", "vocab_size", "slots_total", "slots_used", "max_seq_len", "kv_bytes_per_slot", "weight_bytes", "sessions", "evictions", "self_drafters", "forwards", "max_tree_nodes", "batches", "batched_requests", "max_batch_seen", "decode_steps", "context_drafters", "prefix_cache", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_bytes", "prefix_cache_capacity_bytes", "prefix_cache_budget_bytes", "prefix_cache_blocks", "prefix_cache_blocks_held", "prefix_cache_evictions", "prefix_cache_block_size", "prefill_steps")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SELF_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    vocab_size: int
    slots_total: int
    slots_used: int
    max_seq_len: int
    kv_bytes_per_slot: int
    weight_bytes: int
    sessions: _containers.RepeatedScalarFieldContainer[str]
    evictions: int
    self_drafters: _containers.RepeatedScalarFieldContainer[str]
    forwards: int
    max_tree_nodes: int
    batches: int
    batched_requests: int
    max_batch_seen: int
    decode_steps: int
    context_drafters: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_bytes: int
    prefix_cache_capacity_bytes: int
    prefix_cache_budget_bytes: int
    prefix_cache_blocks: int
    prefix_cache_blocks_held: int
    prefix_cache_evictions: int
    prefix_cache_block_size: int
    prefill_steps: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., slots_total: _Optional[int] = ..., slots_used: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., kv_bytes_per_slot: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., sessions: _Optional[_Iterable[str]] = ..., evictions: _Optional[int] = ..., self_drafters: _Optional[_Iterable[str]] = ..., forwards: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., batches: _Optional[int] = ..., batched_requests: _Optional[int] = ..., max_batch_seen: _Optional[int] = ..., decode_steps: _Optional[int] = ..., context_drafters: _Optional[_Iterable[str]] = ..., prefix_cache: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., prefix_cache_capacity_bytes: _Optional[int] = ..., prefix_cache_budget_bytes: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_blocks_held: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., prefix_cache_block_size: _Optional[int] = ..., prefill_steps: _Optional[int] = ...) -> None: ...
