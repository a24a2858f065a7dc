from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
    KVSTORE: _ClassVar[Role]

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[InstanceState]
    ALIVE: _ClassVar[InstanceState]
    DRAINING: _ClassVar[InstanceState]
    DEAD: _ClassVar[InstanceState]
    SUSPECT: _ClassVar[InstanceState]
ROLE_UNSPECIFIED: Role
PREFILL: Role
DECODE: Role
KVSTORE: Role
STATE_UNSPECIFIED: InstanceState
ALIVE: InstanceState
DRAINING: InstanceState
DEAD: InstanceState
SUSPECT: InstanceState

class InFlightPrompt(_message.Message):
    __slots__ = ("prompt_tokens", "computed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    computed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("queued_requests", "queued_s", "running_requests", "context_tokens", "free_kv_blocks", "step_s", "batch_cap", "landing_blocks", "received_requests", "step_batch", "step_context_tokens", "queued_tokens", "running_blocks", "landing_held_blocks", "prompts", "waiting_requests", "waiting_s")
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_CAP_FIELD_NUMBER: _ClassVar[int]
    LANDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEP_BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LANDING_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    queued_requests: int
    queued_s: float
    running_requests: int
    context_tokens: int
    free_kv_blocks: int
    step_s: float
    batch_cap: int
    landing_blocks: int
    received_requests: int
    step_batch: float
    step_context_tokens: float
    queued_tokens: int
    running_blocks: int
    landing_held_blocks: int
    prompts: _containers.RepeatedCompositeFieldContainer[InFlightPrompt]
    waiting_requests: int
    waiting_s: float
    def __init__(self, queued_requests: _Optional[int] = ..., queued_s: _Optional[float] = ..., running_requests: _Optional[int] = ..., context_tokens: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., step_s: _Optional[float] = ..., batch_cap: _Optional[int] = ..., landing_blocks: _Optional[int] = ..., received_requests: _Optional[int] = ..., step_batch: _Optional[float] = ..., step_context_tokens: _Optional[float] = ..., queued_tokens: _Optional[int] = ..., running_blocks: _Optional[int] = ..., landing_held_blocks: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[InFlightPrompt, _Mapping]]] = ..., waiting_requests: _Optional[int] = ..., waiting_s: _Optional[float] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("id", "role", "address", "node", "model", "capacity", "fingerprint", "engine", "pipeline_stages", "pipeline_chunk", "transport", "step_tokens", "block_bytes", "kv_blocks", "kv_shared", "tensor_parallel_size", "block_size", "kv_dtype", "pool_kv_dtype")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SHARED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    POOL_KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: Role
    address: str
    node: str
    model: str
    capacity: int
    fingerprint: bytes
    engine: str
    pipeline_stages: int
    pipeline_chunk: int
    transport: str
    step_tokens: int
    block_bytes: int
    kv_blocks: int
    kv_shared: bool
    tensor_parallel_size: int
    block_size: int
    kv_dtype: str
    pool_kv_dtype: str
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., model: _Optional[str] = ..., capacity: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., engine: _Optional[str] = ..., pipeline_stages: _Optional[int] = ..., pipeline_chunk: _Optional[int] = ..., transport: _Optional[str] = ..., step_tokens: _Optional[int] = ..., block_bytes: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_shared: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., pool_kv_dtype: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "heartbeat_timeout_s", "instance_token")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    instance_token: bytes
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., instance_token: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "load")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    id: str
    load: Load
    def __init__(self, id: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "batch_cap")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    BATCH_CAP_FIELD_NUMBER: _ClassVar[int]
    known: bool
    batch_cap: int
    def __init__(self, known: _Optional[bool] = ..., batch_cap: _Optional[int] = ...) -> None: ...

class PrefillSample(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class TransferSample(_message.Message):
    __slots__ = ("bytes", "seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class RequestEvent(_message.Message):
    __slots__ = ("request_id", "kind", "measured_ttft_s", "handoff_s", "queue_s", "prefill_s", "output_tokens", "measured_tbt_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[RequestEvent.Kind]
        DECODE_STARTED: _ClassVar[RequestEvent.Kind]
        FINISHED: _ClassVar[RequestEvent.Kind]
    KIND_UNSPECIFIED: RequestEvent.Kind
    DECODE_STARTED: RequestEvent.Kind
    FINISHED: RequestEvent.Kind
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TBT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: RequestEvent.Kind
    measured_ttft_s: float
    handoff_s: float
    queue_s: float
    prefill_s: float
    output_tokens: int
    measured_tbt_s: float
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[_Union[RequestEvent.Kind, str]] = ..., measured_ttft_s: _Optional[float] = ..., handoff_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., output_tokens: _Optional[int] = ..., measured_tbt_s: _Optional[float] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("id", "prefill", "transfer", "requests")
    ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillSample]
    transfer: _containers.RepeatedCompositeFieldContainer[TransferSample]
    requests: _containers.RepeatedCompositeFieldContainer[RequestEvent]
    def __init__(self, id: _Optional[str] = ..., prefill: _Optional[_Iterable[_Union[PrefillSample, _Mapping]]] = ..., transfer: _Optional[_Iterable[_Union[TransferSample, _Mapping]]] = ..., requests: _Optional[_Iterable[_Union[RequestEvent, _Mapping]]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "keys", "prompt_tokens", "block_tokens", "expected_output_tokens", "slo_class", "key_chain", "failed", "probe", "priority", "tenant", "waited_s", "tenant_weight", "retry", "follows", "ttft_slo_s", "tbt_slo_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    KEY_CHAIN_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    block_tokens: int
    expected_output_tokens: int
    slo_class: str
    key_chain: bytes
    failed: _containers.RepeatedScalarFieldContainer[str]
    probe: bool
    priority: int
    tenant: str
    waited_s: float
    tenant_weight: float
    retry: bool
    follows: str
    ttft_slo_s: float
    tbt_slo_s: float
    def __init__(self, request_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ..., block_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., slo_class: _Optional[str] = ..., key_chain: _Optional[bytes] = ..., failed: _Optional[_Iterable[str]] = ..., probe: _Optional[bool] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., waited_s: _Optional[float] = ..., tenant_weight: _Optional[float] = ..., retry: _Optional[bool] = ..., follows: _Optional[str] = ..., ttft_slo_s: _Optional[float] = ..., tbt_slo_s: _Optional[float] = ...) -> None: ...

class PrefixPlan(_message.Message):
    __slots__ = ("local_blocks", "fetch_node", "fetch_address", "fetch_blocks", "compute_tokens", "keep_fetched")
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_NODE_FIELD_NUMBER: _ClassVar[int]
    FETCH_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FETCHED_FIELD_NUMBER: _ClassVar[int]
    local_blocks: int
    fetch_node: str
    fetch_address: str
    fetch_blocks: int
    compute_tokens: int
    keep_fetched: bool
    def __init__(self, local_blocks: _Optional[int] = ..., fetch_node: _Optional[str] = ..., fetch_address: _Optional[str] = ..., fetch_blocks: _Optional[int] = ..., compute_tokens: _Optional[int] = ..., keep_fetched: _Optional[bool] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("ttft_s", "tbt_s", "queue_s", "transfer_s", "prefill_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TBT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tbt_s: float
    queue_s: float
    transfer_s: float
    prefill_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., tbt_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill_id", "prefill_address", "prefill_node", "decode_id", "decode_address", "plan", "policy", "prefill_node_address", "local_prefill", "local_chunk_tokens", "admit_at_decode", "ahead", "narrow_handoff")
    PREFILL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AT_DECODE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    NARROW_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    prefill_id: str
    prefill_address: str
    prefill_node: str
    decode_id: str
    decode_address: str
    plan: PrefixPlan
    policy: str
    prefill_node_address: str
    local_prefill: bool
    local_chunk_tokens: int
    admit_at_decode: bool
    ahead: bool
    narrow_handoff: bool
    def __init__(self, prefill_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., prefill_node: _Optional[str] = ..., decode_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., plan: _Optional[_Union[PrefixPlan, _Mapping]] = ..., policy: _Optional[str] = ..., prefill_node_address: _Optional[str] = ..., local_prefill: _Optional[bool] = ..., local_chunk_tokens: _Optional[int] = ..., admit_at_decode: _Optional[bool] = ..., ahead: _Optional[bool] = ..., narrow_handoff: _Optional[bool] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("reason", "message", "retry_after_s", "offer_slo_class")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    OFFER_SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    retry_after_s: float
    offer_slo_class: str
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., offer_slo_class: _Optional[str] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("placement", "rejection", "predicted", "shed_s", "wait_s")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    SHED_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    rejection: Rejection
    predicted: Prediction
    shed_s: float
    wait_s: float
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., rejection: _Optional[_Union[Rejection, _Mapping]] = ..., predicted: _Optional[_Union[Prediction, _Mapping]] = ..., shed_s: _Optional[float] = ..., wait_s: _Optional[float] = ...) -> None: ...

class AdmitAtDecodeRequest(_message.Message):
    __slots__ = ("decode_id", "context_tokens")
    DECODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    decode_id: str
    context_tokens: int
    def __init__(self, decode_id: _Optional[str] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class AdmitAtDecodeResponse(_message.Message):
    __slots__ = ("admit", "rejection")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    admit: bool
    rejection: Rejection
    def __init__(self, admit: _Optional[bool] = ..., rejection: _Optional[_Union[Rejection, _Mapping]] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("id", "role", "address", "node", "model", "capacity", "state", "heartbeat_age_s", "load", "indexed_blocks", "dram_blocks", "decisions", "prompt_blocks", "reused_blocks", "fetched_blocks", "retiring", "engine", "pipeline_stages", "pipeline_chunk", "placed_in_prefill", "placed_decoding", "landing_held", "transport", "kv_blocks", "kv_held", "tensor_parallel_size", "block_size", "kv_dtype", "pool_kv_dtype")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETIRING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    PLACED_IN_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PLACED_DECODING_FIELD_NUMBER: _ClassVar[int]
    LANDING_HELD_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HELD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    POOL_KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: Role
    address: str
    node: str
    model: str
    capacity: int
    state: InstanceState
    heartbeat_age_s: float
    load: Load
    indexed_blocks: int
    dram_blocks: int
    decisions: int
    prompt_blocks: int
    reused_blocks: int
    fetched_blocks: int
    retiring: bool
    engine: str
    pipeline_stages: int
    pipeline_chunk: int
    placed_in_prefill: int
    placed_decoding: int
    landing_held: int
    transport: str
    kv_blocks: int
    kv_held: int
    tensor_parallel_size: int
    block_size: int
    kv_dtype: str
    pool_kv_dtype: str
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., node: _Optional[str] = ..., model: _Optional[str] = ..., capacity: _Optional[int] = ..., state: _Optional[_Union[InstanceState, str]] = ..., heartbeat_age_s: _Optional[float] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., indexed_blocks: _Optional[int] = ..., dram_blocks: _Optional[int] = ..., decisions: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., reused_blocks: _Optional[int] = ..., fetched_blocks: _Optional[int] = ..., retiring: _Optional[bool] = ..., engine: _Optional[str] = ..., pipeline_stages: _Optional[int] = ..., pipeline_chunk: _Optional[int] = ..., placed_in_prefill: _Optional[int] = ..., placed_decoding: _Optional[int] = ..., landing_held: _Optional[int] = ..., transport: _Optional[str] = ..., kv_blocks: _Optional[int] = ..., kv_held: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., pool_kv_dtype: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "policy", "admission", "index_blocks", "scheduled", "rejected", "control_port", "admin_open", "insecure", "plan", "quote_held", "quotes_measured")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class QuoteHeldEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class QuotesMeasuredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_OPEN_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    QUOTE_HELD_FIELD_NUMBER: _ClassVar[int]
    QUOTES_MEASURED_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    policy: str
    admission: str
    index_blocks: int
    scheduled: int
    rejected: _containers.ScalarMap[str, int]
    control_port: int
    admin_open: bool
    insecure: bool
    plan: PlanResponse
    quote_held: _containers.ScalarMap[str, float]
    quotes_measured: _containers.ScalarMap[str, int]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., policy: _Optional[str] = ..., admission: _Optional[str] = ..., index_blocks: _Optional[int] = ..., scheduled: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., control_port: _Optional[int] = ..., admin_open: _Optional[bool] = ..., insecure: _Optional[bool] = ..., plan: _Optional[_Union[PlanResponse, _Mapping]] = ..., quote_held: _Optional[_Mapping[str, float]] = ..., quotes_measured: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("id", "remove")
    ID_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    id: str
    remove: bool
    def __init__(self, id: _Optional[str] = ..., remove: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: InstanceState
    def __init__(self, state: _Optional[_Union[InstanceState, str]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("id", "instance_token", "hand_off")
    ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    id: str
    instance_token: bytes
    hand_off: bool
    def __init__(self, id: _Optional[str] = ..., instance_token: _Optional[bytes] = ..., hand_off: _Optional[bool] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy", "admission")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    policy: str
    admission: str
    def __init__(self, policy: _Optional[str] = ..., admission: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("policy", "admission")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    policy: str
    admission: str
    def __init__(self, policy: _Optional[str] = ..., admission: _Optional[str] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("role", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    replicas: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("provider", "alive", "started", "draining")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    provider: str
    alive: int
    started: _containers.RepeatedScalarFieldContainer[str]
    draining: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, provider: _Optional[str] = ..., alive: _Optional[int] = ..., started: _Optional[_Iterable[str]] = ..., draining: _Optional[_Iterable[str]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("now",)
    NOW_FIELD_NUMBER: _ClassVar[int]
    now: bool
    def __init__(self, now: _Optional[bool] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("acting", "prefill", "decode", "forecast_rate", "age_s", "reasoning", "interval_s")
    ACTING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    FORECAST_RATE_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    acting: bool
    prefill: int
    decode: int
    forecast_rate: float
    age_s: float
    reasoning: str
    interval_s: float
    def __init__(self, acting: _Optional[bool] = ..., prefill: _Optional[int] = ..., decode: _Optional[int] = ..., forecast_rate: _Optional[float] = ..., age_s: _Optional[float] = ..., reasoning: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...
