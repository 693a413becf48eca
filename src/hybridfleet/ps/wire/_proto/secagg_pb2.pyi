from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdvertiseRequest(_message.Message):
    __slots__ = ("worker_id", "public_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    public_key: bytes
    def __init__(self, worker_id: _Optional[str] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class AdvertiseResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class RosterRequest(_message.Message):
    __slots__ = ("worker_id", "known_epoch", "timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    known_epoch: int
    timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., known_epoch: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RosterEntry(_message.Message):
    __slots__ = ("worker_id", "public_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    public_key: bytes
    def __init__(self, worker_id: _Optional[str] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class RosterResponse(_message.Message):
    __slots__ = ("epoch", "threshold", "entries")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    threshold: int
    entries: _containers.RepeatedCompositeFieldContainer[RosterEntry]
    def __init__(self, epoch: _Optional[int] = ..., threshold: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[RosterEntry, _Mapping]]] = ...) -> None: ...

class Ciphertext(_message.Message):
    __slots__ = ("peer", "data")
    PEER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    peer: str
    data: bytes
    def __init__(self, peer: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SharesRequest(_message.Message):
    __slots__ = ("worker_id", "round", "epoch", "shares")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    round: int
    epoch: int
    shares: _containers.RepeatedCompositeFieldContainer[Ciphertext]
    def __init__(self, worker_id: _Optional[str] = ..., round: _Optional[int] = ..., epoch: _Optional[int] = ..., shares: _Optional[_Iterable[_Union[Ciphertext, _Mapping]]] = ...) -> None: ...

class SharesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnmaskRequest(_message.Message):
    __slots__ = ("worker_id", "round", "timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    round: int
    timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., round: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class UnmaskResponse(_message.Message):
    __slots__ = ("survivors", "dropped", "shares")
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    shares: _containers.RepeatedCompositeFieldContainer[Ciphertext]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ..., shares: _Optional[_Iterable[_Union[Ciphertext, _Mapping]]] = ...) -> None: ...

class Share(_message.Message):
    __slots__ = ("owner", "value")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    value: bytes
    def __init__(self, owner: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class PairSeed(_message.Message):
    __slots__ = ("peer", "seed")
    PEER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    peer: str
    seed: bytes
    def __init__(self, peer: _Optional[str] = ..., seed: _Optional[bytes] = ...) -> None: ...

class RevealRequest(_message.Message):
    __slots__ = ("worker_id", "round", "shares", "pair_seeds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    PAIR_SEEDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    round: int
    shares: _containers.RepeatedCompositeFieldContainer[Share]
    pair_seeds: _containers.RepeatedCompositeFieldContainer[PairSeed]
    def __init__(self, worker_id: _Optional[str] = ..., round: _Optional[int] = ..., shares: _Optional[_Iterable[_Union[Share, _Mapping]]] = ..., pair_seeds: _Optional[_Iterable[_Union[PairSeed, _Mapping]]] = ...) -> None: ...

class RevealResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
