from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "acceptance", "typical_epsilon", "typical_delta", "lenience", "accept_top_k", "cd_alpha", "cd_beta", "cd_amateur", "jsd_threshold", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "logprobs", "grammar_kind", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_EPSILON_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_DELTA_FIELD_NUMBER: _ClassVar[int]
    LENIENCE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    CD_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CD_BETA_FIELD_NUMBER: _ClassVar[int]
    CD_AMATEUR_FIELD_NUMBER: _ClassVar[int]
    JSD_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    acceptance: str
    typical_epsilon: float
    typical_delta: float
    lenience: float
    accept_top_k: int
    cd_alpha: float
    cd_beta: float
    cd_amateur: str
    jsd_threshold: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    logprobs: int
    grammar_kind: str
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., acceptance: _Optional[str] = ..., typical_epsilon: _Optional[float] = ..., typical_delta: _Optional[float] = ..., lenience: _Optional[float] = ..., accept_top_k: _Optional[int] = ..., cd_alpha: _Optional[float] = ..., cd_beta: _Optional[float] = ..., cd_amateur: _Optional[str] = ..., jsd_threshold: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs", "token", "token_bytes", "top_tokens", "top_token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token: str
    token_bytes: bytes
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    top_token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., top_tokens: _Optional[_Iterable[str]] = ..., top_token_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "q", "siblings")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    siblings: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., siblings: _Optional[str] = ...) -> None: ...

class SessionSync(_message.Message):
    __slots__ = ("keep_len", "append_tokens")
    KEEP_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    keep_len: int
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keep_len: _Optional[int] = ..., append_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class HiddenFeatures(_message.Message):
    __slots__ = ("start", "rows", "dim", "layers", "dtype", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    dim: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("strategy", "strategy_reason", "drafter", "prompt_tokens", "new_tokens", "rounds", "target_forwards", "drafted_tokens", "accepted_tokens", "tau", "accept_hist", "position_drafted", "position_accepted", "position_acceptance", "draft_s", "verify_s", "prefill_s", "network_s", "total_s", "ttft_s", "tokens_per_s", "finish_reason", "lossy", "fallbacks", "verifier", "reprefills", "cache_hit", "cache_drafted_tokens", "cache_accepted_tokens", "warm_prefix_tokens", "thinking_tokens", "answer_tokens", "answer_s", "side_branches", "side_tokens", "acceptance", "resumed_tokens", "ahead_hits", "ahead_misses", "ahead_wasted", "forced_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens", "cached_tokens")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_HIST_FIELD_NUMBER: _ClassVar[int]
    POSITION_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    POSITION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    POSITION_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NETWORK_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    REPREFILLS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_S_FIELD_NUMBER: _ClassVar[int]
    SIDE_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    SIDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_WASTED_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    strategy_reason: str
    drafter: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    target_forwards: int
    drafted_tokens: int
    accepted_tokens: int
    tau: float
    accept_hist: _containers.RepeatedScalarFieldContainer[int]
    position_drafted: _containers.RepeatedScalarFieldContainer[int]
    position_accepted: _containers.RepeatedScalarFieldContainer[int]
    position_acceptance: _containers.RepeatedScalarFieldContainer[float]
    draft_s: float
    verify_s: float
    prefill_s: float
    network_s: float
    total_s: float
    ttft_s: float
    tokens_per_s: float
    finish_reason: str
    lossy: bool
    fallbacks: int
    verifier: str
    reprefills: int
    cache_hit: bool
    cache_drafted_tokens: int
    cache_accepted_tokens: int
    warm_prefix_tokens: int
    thinking_tokens: int
    answer_tokens: int
    answer_s: float
    side_branches: int
    side_tokens: int
    acceptance: str
    resumed_tokens: int
    ahead_hits: int
    ahead_misses: int
    ahead_wasted: int
    forced_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    cached_tokens: int
    def __init__(self, strategy: _Optional[str] = ..., strategy_reason: _Optional[str] = ..., drafter: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., target_forwards: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., tau: _Optional[float] = ..., accept_hist: _Optional[_Iterable[int]] = ..., position_drafted: _Optional[_Iterable[int]] = ..., position_accepted: _Optional[_Iterable[int]] = ..., position_acceptance: _Optional[_Iterable[float]] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., network_s: _Optional[float] = ..., total_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., finish_reason: _Optional[str] = ..., lossy: _Optional[bool] = ..., fallbacks: _Optional[int] = ..., verifier: _Optional[str] = ..., reprefills: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., cache_drafted_tokens: _Optional[int] = ..., cache_accepted_tokens: _Optional[int] = ..., warm_prefix_tokens: _Optional[int] = ..., thinking_tokens: _Optional[int] = ..., answer_tokens: _Optional[int] = ..., answer_s: _Optional[float] = ..., side_branches: _Optional[int] = ..., side_tokens: _Optional[int] = ..., acceptance: _Optional[str] = ..., resumed_tokens: _Optional[int] = ..., ahead_hits: _Optional[int] = ..., ahead_misses: _Optional[int] = ..., ahead_wasted: _Optional[int] = ..., forced_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
