from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]

class LeaseStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATUS_UNSPECIFIED: _ClassVar[LeaseStatus]
    LEASE_STATUS_OK: _ClassVar[LeaseStatus]
    LEASE_STATUS_NO_FREE_BLOCKS: _ClassVar[LeaseStatus]
    LEASE_STATUS_NOT_FOUND: _ClassVar[LeaseStatus]
    LEASE_STATUS_PERMISSION_DENIED: _ClassVar[LeaseStatus]
    LEASE_STATUS_INVALID_ARGUMENT: _ClassVar[LeaseStatus]
    LEASE_STATUS_LIMIT_EXCEEDED: _ClassVar[LeaseStatus]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_FLOAT8_E5M2: DType
LEASE_STATUS_UNSPECIFIED: LeaseStatus
LEASE_STATUS_OK: LeaseStatus
LEASE_STATUS_NO_FREE_BLOCKS: LeaseStatus
LEASE_STATUS_NOT_FOUND: LeaseStatus
LEASE_STATUS_PERMISSION_DENIED: LeaseStatus
LEASE_STATUS_INVALID_ARGUMENT: LeaseStatus
LEASE_STATUS_LIMIT_EXCEEDED: LeaseStatus

class Geometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "device")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    device: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., device: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "geometry", "workspace_bytes", "max_model_len", "model_fingerprint", "served_model_name", "attach_key", "weights_bytes", "weights_bytes_by_type", "lora_slot_bytes", "lora_resident_bytes")
    class WeightsBytesByTypeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ATTACH_KEY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_BY_TYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    geometry: Geometry
    workspace_bytes: int
    max_model_len: int
    model_fingerprint: str
    served_model_name: str
    attach_key: str
    weights_bytes: int
    weights_bytes_by_type: _containers.ScalarMap[str, int]
    lora_slot_bytes: int
    lora_resident_bytes: int
    def __init__(self, client_name: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., workspace_bytes: _Optional[int] = ..., max_model_len: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., served_model_name: _Optional[str] = ..., attach_key: _Optional[str] = ..., weights_bytes: _Optional[int] = ..., weights_bytes_by_type: _Optional[_Mapping[str, int]] = ..., lora_slot_bytes: _Optional[int] = ..., lora_resident_bytes: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session_id", "lease_ttl_ms", "sizing", "pool", "supports_truncate")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SIZING_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ttl_ms: int
    sizing: SizingReport
    pool: PoolHandle
    supports_truncate: bool
    def __init__(self, session_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., sizing: _Optional[_Union[SizingReport, _Mapping]] = ..., pool: _Optional[_Union[PoolHandle, _Mapping]] = ..., supports_truncate: _Optional[bool] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("shape", "dtype", "device", "shared_memory", "cuda_ipc")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    device: str
    shared_memory: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., device: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("path", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "stride", "storage_offset")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    def __init__(self, device_index: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ...) -> None: ...

class HoldSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HoldSessionResponse(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("blocks_reclaimed",)
    BLOCKS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    blocks_reclaimed: int
    def __init__(self, blocks_reclaimed: _Optional[int] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("num_tokens", "prompt_token_ids", "cache_salt", "lora_name")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora_name: str
    def __init__(self, num_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ExtendOp(_message.Message):
    __slots__ = ("sequence_id", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ForkOp(_message.Message):
    __slots__ = ("sequence_id", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ReleaseOp(_message.Message):
    __slots__ = ("sequence_id", "cache_prefix", "token_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    cache_prefix: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., cache_prefix: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitOp(_message.Message):
    __slots__ = ("sequence_id", "token_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TruncateOp(_message.Message):
    __slots__ = ("sequence_id", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class LeaseOp(_message.Message):
    __slots__ = ("allocate", "extend", "fork", "release", "commit", "truncate")
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    allocate: AllocateOp
    extend: ExtendOp
    fork: ForkOp
    release: ReleaseOp
    commit: CommitOp
    truncate: TruncateOp
    def __init__(self, allocate: _Optional[_Union[AllocateOp, _Mapping]] = ..., extend: _Optional[_Union[ExtendOp, _Mapping]] = ..., fork: _Optional[_Union[ForkOp, _Mapping]] = ..., release: _Optional[_Union[ReleaseOp, _Mapping]] = ..., commit: _Optional[_Union[CommitOp, _Mapping]] = ..., truncate: _Optional[_Union[TruncateOp, _Mapping]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("session_id", "ops")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ops: _containers.RepeatedCompositeFieldContainer[LeaseOp]
    def __init__(self, session_id: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[LeaseOp, _Mapping]]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src_block", "dst_block")
    SRC_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    src_block: int
    dst_block: int
    def __init__(self, src_block: _Optional[int] = ..., dst_block: _Optional[int] = ...) -> None: ...

class LeaseResult(_message.Message):
    __slots__ = ("status", "message", "sequence_id", "block_ids", "cached_tokens", "copy", "blocks_released", "blocks_committed", "cached_tokens_host", "cached_tokens_disk", "cached_tokens_remote")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_HOST_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_REMOTE_FIELD_NUMBER: _ClassVar[int]
    status: LeaseStatus
    message: str
    sequence_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    copy: BlockCopy
    blocks_released: int
    blocks_committed: int
    cached_tokens_host: int
    cached_tokens_disk: int
    cached_tokens_remote: int
    def __init__(self, status: _Optional[_Union[LeaseStatus, str]] = ..., message: _Optional[str] = ..., sequence_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., copy: _Optional[_Union[BlockCopy, _Mapping]] = ..., blocks_released: _Optional[int] = ..., blocks_committed: _Optional[int] = ..., cached_tokens_host: _Optional[int] = ..., cached_tokens_disk: _Optional[int] = ..., cached_tokens_remote: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("results", "blocks_available")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    blocks_available: int
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ..., blocks_available: _Optional[int] = ...) -> None: ...

class GetSizingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SizingReport(_message.Message):
    __slots__ = ("block_size", "bytes_per_block", "num_blocks", "max_total_tokens", "device", "dtype", "memory_total_bytes", "memory_free_bytes", "memory_fraction", "workspace_bytes", "headroom", "limited_by", "budget_bytes", "pool_bytes", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "max_model_len", "max_full_length_sequences", "explanation", "host_cache_bytes", "host_blocks", "disk_cache_bytes", "disk_blocks", "weights_bytes", "weights_bytes_by_type", "lora_slot_bytes", "lora_resident_bytes")
    class WeightsBytesByTypeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_FIELD_NUMBER: _ClassVar[int]
    LIMITED_BY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_FULL_LENGTH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_BY_TYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_total_tokens: int
    device: str
    dtype: DType
    memory_total_bytes: int
    memory_free_bytes: int
    memory_fraction: float
    workspace_bytes: int
    headroom: float
    limited_by: str
    budget_bytes: int
    pool_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_model_len: int
    max_full_length_sequences: float
    explanation: _containers.RepeatedScalarFieldContainer[str]
    host_cache_bytes: int
    host_blocks: int
    disk_cache_bytes: int
    disk_blocks: int
    weights_bytes: int
    weights_bytes_by_type: _containers.ScalarMap[str, int]
    lora_slot_bytes: int
    lora_resident_bytes: int
    def __init__(self, block_size: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., memory_total_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., memory_fraction: _Optional[float] = ..., workspace_bytes: _Optional[int] = ..., headroom: _Optional[float] = ..., limited_by: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype_bytes: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_full_length_sequences: _Optional[float] = ..., explanation: _Optional[_Iterable[str]] = ..., host_cache_bytes: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_cache_bytes: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., weights_bytes_by_type: _Optional[_Mapping[str, int]] = ..., lora_slot_bytes: _Optional[int] = ..., lora_resident_bytes: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("session_id", "all_models")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_MODELS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    all_models: bool
    def __init__(self, session_id: _Optional[str] = ..., all_models: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("blocks_dropped", "blocks_kept")
    BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_KEPT_FIELD_NUMBER: _ClassVar[int]
    blocks_dropped: int
    blocks_kept: int
    def __init__(self, blocks_dropped: _Optional[int] = ..., blocks_kept: _Optional[int] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("blocks_total", "blocks_free", "blocks_leased", "blocks_cached", "sessions", "sequences", "prefix_queries", "prefix_hits", "bytes_reserved", "tiers", "models", "blocks_truncated")
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LEASED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESERVED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    blocks_total: int
    blocks_free: int
    blocks_leased: int
    blocks_cached: int
    sessions: int
    sequences: int
    prefix_queries: int
    prefix_hits: int
    bytes_reserved: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    models: _containers.RepeatedCompositeFieldContainer[ModelStats]
    blocks_truncated: int
    def __init__(self, blocks_total: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_leased: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., sessions: _Optional[int] = ..., sequences: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., bytes_reserved: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelStats, _Mapping]]] = ..., blocks_truncated: _Optional[int] = ...) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("model_fingerprint", "served_model_names", "sessions", "sequences", "blocks_leased", "prefix_queries", "prefix_hits")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LEASED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    sessions: int
    sequences: int
    blocks_leased: int
    prefix_queries: int
    prefix_hits: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., sessions: _Optional[int] = ..., sequences: _Optional[int] = ..., blocks_leased: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "blocks_total", "blocks_cached", "blocks_free", "hit_tokens", "demotions", "promotions", "bytes_in", "bytes_out", "seconds_in", "seconds_out", "evictions", "errors", "bytes_used", "blocks_queued")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_IN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_OUT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks_total: int
    blocks_cached: int
    blocks_free: int
    hit_tokens: int
    demotions: int
    promotions: int
    bytes_in: int
    bytes_out: int
    seconds_in: float
    seconds_out: float
    evictions: int
    errors: int
    bytes_used: int
    blocks_queued: int
    def __init__(self, tier: _Optional[str] = ..., blocks_total: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., blocks_free: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., seconds_in: _Optional[float] = ..., seconds_out: _Optional[float] = ..., evictions: _Optional[int] = ..., errors: _Optional[int] = ..., bytes_used: _Optional[int] = ..., blocks_queued: _Optional[int] = ...) -> None: ...
