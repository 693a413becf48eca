from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("wire_version", "worker_id", "site", "rank", "params", "num_shards", "block_size_bytes", "codec", "framework")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    worker_id: str
    site: str
    rank: int
    params: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_shards: int
    block_size_bytes: int
    codec: str
    framework: str
    def __init__(self, wire_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., site: _Optional[str] = ..., rank: _Optional[int] = ..., params: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_shards: _Optional[int] = ..., block_size_bytes: _Optional[int] = ..., codec: _Optional[str] = ..., framework: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("wire_version", "shard", "plan_json", "version", "initialized", "sync", "staleness_bound", "worker_clock", "live_workers", "heartbeat_interval_s", "bulk_port")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BOUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    shard: int
    plan_json: str
    version: int
    initialized: bool
    sync: str
    staleness_bound: int
    worker_clock: int
    live_workers: _containers.RepeatedScalarFieldContainer[str]
    heartbeat_interval_s: float
    bulk_port: int
    def __init__(self, wire_version: _Optional[int] = ..., shard: _Optional[int] = ..., plan_json: _Optional[str] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ..., sync: _Optional[str] = ..., staleness_bound: _Optional[int] = ..., worker_clock: _Optional[int] = ..., live_workers: _Optional[_Iterable[str]] = ..., heartbeat_interval_s: _Optional[float] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "since_version", "wait_for_version", "worker_clock", "timeout_s", "init_digest")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_CLOCK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    INIT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    since_version: int
    wait_for_version: int
    worker_clock: int
    timeout_s: float
    init_digest: str
    def __init__(self, worker_id: _Optional[str] = ..., since_version: _Optional[int] = ..., wait_for_version: _Optional[int] = ..., worker_clock: _Optional[int] = ..., timeout_s: _Optional[float] = ..., init_digest: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("key", "offset", "total_bytes", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    total_bytes: int
    data: bytes
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("version", "chunk", "delta_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DELTA_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk: TensorChunk
    delta_version: int
    def __init__(self, version: _Optional[int] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., delta_version: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "step", "base_version", "kind", "codec", "keys", "contributors", "optimizer_json", "skip_nonfinite")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        GRADIENT: _ClassVar[PushHeader.Kind]
        INIT: _ClassVar[PushHeader.Kind]
    GRADIENT: PushHeader.Kind
    INIT: PushHeader.Kind
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    SKIP_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    base_version: int
    kind: PushHeader.Kind
    codec: str
    keys: _containers.RepeatedCompositeFieldContainer[KeyBytes]
    contributors: int
    optimizer_json: str
    skip_nonfinite: bool
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., kind: _Optional[_Union[PushHeader.Kind, str]] = ..., codec: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[KeyBytes, _Mapping]]] = ..., contributors: _Optional[int] = ..., optimizer_json: _Optional[str] = ..., skip_nonfinite: _Optional[bool] = ...) -> None: ...

class KeyBytes(_message.Message):
    __slots__ = ("key", "nbytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    nbytes: int
    def __init__(self, key: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "applied")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    def __init__(self, version: _Optional[int] = ..., applied: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("version", "live_workers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    live_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., live_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
