from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "config_json", "tensor_names")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ..., tensor_names: _Optional[_Iterable[str]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("version", "tensors", "lora", "part")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    lora: LoraAdapter
    part: VersionPart
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ..., part: _Optional[_Union[VersionPart, _Mapping]] = ...) -> None: ...

class VersionPart(_message.Message):
    __slots__ = ("index", "count", "sender_id", "plan_digest", "num_tensors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    sender_id: str
    plan_digest: str
    num_tensors: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., sender_id: _Optional[str] = ..., plan_digest: _Optional[str] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "device_index", "memory_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    device_index: int
    memory_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., memory_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class BufferHandle(_message.Message):
    __slots__ = ("buffer_id", "nbytes", "shm", "cuda_ipc")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    nbytes: int
    shm: ShmHandle
    cuda_ipc: CudaIpcHandle
    def __init__(self, buffer_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class BucketEntry(_message.Message):
    __slots__ = ("tensor", "offset", "nbytes", "tensor_offset", "chunk_index", "num_chunks", "source", "box_start")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BOX_START_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorSpec
    offset: int
    nbytes: int
    tensor_offset: int
    chunk_index: int
    num_chunks: int
    source: int
    box_start: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensor: _Optional[_Union[TensorSpec, _Mapping]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., tensor_offset: _Optional[int] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., source: _Optional[int] = ..., box_start: _Optional[_Iterable[int]] = ...) -> None: ...

class BucketLayout(_message.Message):
    __slots__ = ("index", "is_last", "nbytes", "entries")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    index: int
    is_last: bool
    nbytes: int
    entries: _containers.RepeatedCompositeFieldContainer[BucketEntry]
    def __init__(self, index: _Optional[int] = ..., is_last: _Optional[bool] = ..., nbytes: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[BucketEntry, _Mapping]]] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("code", "message", "tensor")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    tensor: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., tensor: _Optional[str] = ...) -> None: ...

class PublisherHello(_message.Message):
    __slots__ = ("publisher_id", "rank", "world_size", "device", "device_uuid", "lanes", "staged_in_done")
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    STAGED_IN_DONE_FIELD_NUMBER: _ClassVar[int]
    publisher_id: str
    rank: int
    world_size: int
    device: str
    device_uuid: str
    lanes: bool
    staged_in_done: bool
    def __init__(self, publisher_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., lanes: _Optional[bool] = ..., staged_in_done: _Optional[bool] = ...) -> None: ...

class SourcePiece(_message.Message):
    __slots__ = ("name", "source", "offset", "dtype", "size", "stride", "dst_start", "ready")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    DST_START_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: int
    offset: int
    dtype: str
    size: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    dst_start: _containers.RepeatedScalarFieldContainer[int]
    ready: int
    def __init__(self, name: _Optional[str] = ..., source: _Optional[int] = ..., offset: _Optional[int] = ..., dtype: _Optional[str] = ..., size: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., dst_start: _Optional[_Iterable[int]] = ..., ready: _Optional[int] = ...) -> None: ...

class BeginVersion(_message.Message):
    __slots__ = ("manifest", "sources", "wait_applied", "pieces", "allow_direct", "begin_key", "ready")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    WAIT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DIRECT_FIELD_NUMBER: _ClassVar[int]
    BEGIN_KEY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    sources: _containers.RepeatedCompositeFieldContainer[BufferHandle]
    wait_applied: bool
    pieces: _containers.RepeatedCompositeFieldContainer[SourcePiece]
    allow_direct: bool
    begin_key: bytes
    ready: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[BufferHandle, _Mapping]]] = ..., wait_applied: _Optional[bool] = ..., pieces: _Optional[_Iterable[_Union[SourcePiece, _Mapping]]] = ..., allow_direct: _Optional[bool] = ..., begin_key: _Optional[bytes] = ..., ready: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BucketPacked(_message.Message):
    __slots__ = ("version", "index")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: int
    def __init__(self, version: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class PublisherMessage(_message.Message):
    __slots__ = ("hello", "begin", "packed", "error", "lane")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    hello: PublisherHello
    begin: BeginVersion
    packed: BucketPacked
    error: ErrorDetail
    lane: LaneSwitch
    def __init__(self, hello: _Optional[_Union[PublisherHello, _Mapping]] = ..., begin: _Optional[_Union[BeginVersion, _Mapping]] = ..., packed: _Optional[_Union[BucketPacked, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., lane: _Optional[_Union[LaneSwitch, _Mapping]] = ...) -> None: ...

class PublisherWelcome(_message.Message):
    __slots__ = ("bucket_size_bytes", "transport", "last_version", "lane", "begin_keys", "ready_events")
    BUCKET_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_VERSION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    BEGIN_KEYS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    bucket_size_bytes: int
    transport: str
    last_version: int
    lane: LaneOffer
    begin_keys: bool
    ready_events: bool
    def __init__(self, bucket_size_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., last_version: _Optional[int] = ..., lane: _Optional[_Union[LaneOffer, _Mapping]] = ..., begin_keys: _Optional[bool] = ..., ready_events: _Optional[bool] = ...) -> None: ...

class PackBucket(_message.Message):
    __slots__ = ("version", "layout", "buffer")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    version: int
    layout: BucketLayout
    buffer: BufferHandle
    def __init__(self, version: _Optional[int] = ..., layout: _Optional[_Union[BucketLayout, _Mapping]] = ..., buffer: _Optional[_Union[BufferHandle, _Mapping]] = ...) -> None: ...

class VersionStaged(_message.Message):
    __slots__ = ("version", "receivers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    receivers: int
    def __init__(self, version: _Optional[int] = ..., receivers: _Optional[int] = ...) -> None: ...

class SenderReply(_message.Message):
    __slots__ = ("welcome", "pack", "staged", "done", "lane")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    PACK_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    welcome: PublisherWelcome
    pack: PackBucket
    staged: VersionStaged
    done: VersionStatus
    lane: LaneSwitch
    def __init__(self, welcome: _Optional[_Union[PublisherWelcome, _Mapping]] = ..., pack: _Optional[_Union[PackBucket, _Mapping]] = ..., staged: _Optional[_Union[VersionStaged, _Mapping]] = ..., done: _Optional[_Union[VersionStatus, _Mapping]] = ..., lane: _Optional[_Union[LaneSwitch, _Mapping]] = ...) -> None: ...

class LaneOffer(_message.Message):
    __slots__ = ("path", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    token: bytes
    def __init__(self, path: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class LaneSwitch(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReceiverHello(_message.Message):
    __slots__ = ("receiver_id", "engine", "rank", "device", "device_uuid", "transports", "host_id", "applied_version", "dirty", "layout_keys", "batches", "manifest_keys", "lanes", "exports", "deltas")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRTY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEYS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_KEYS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    engine: str
    rank: int
    device: str
    device_uuid: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    applied_version: int
    dirty: bool
    layout_keys: bool
    batches: bool
    manifest_keys: bool
    lanes: bool
    exports: bool
    deltas: bool
    def __init__(self, receiver_id: _Optional[str] = ..., engine: _Optional[str] = ..., rank: _Optional[int] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., applied_version: _Optional[int] = ..., dirty: _Optional[bool] = ..., layout_keys: _Optional[bool] = ..., batches: _Optional[bool] = ..., manifest_keys: _Optional[bool] = ..., lanes: _Optional[bool] = ..., exports: _Optional[bool] = ..., deltas: _Optional[bool] = ...) -> None: ...

class TensorBox(_message.Message):
    __slots__ = ("name", "start", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., start: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ...) -> None: ...

class ManifestVerdict(_message.Message):
    __slots__ = ("version", "accepted", "error", "keeps", "keeps_key", "writes_key")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KEEPS_FIELD_NUMBER: _ClassVar[int]
    KEEPS_KEY_FIELD_NUMBER: _ClassVar[int]
    WRITES_KEY_FIELD_NUMBER: _ClassVar[int]
    version: int
    accepted: bool
    error: ErrorDetail
    keeps: _containers.RepeatedCompositeFieldContainer[TensorBox]
    keeps_key: bytes
    writes_key: bytes
    def __init__(self, version: _Optional[int] = ..., accepted: _Optional[bool] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., keeps: _Optional[_Iterable[_Union[TensorBox, _Mapping]]] = ..., keeps_key: _Optional[bytes] = ..., writes_key: _Optional[bytes] = ...) -> None: ...

class WriteOffer(_message.Message):
    __slots__ = ("key", "sources", "pieces")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    sources: _containers.RepeatedCompositeFieldContainer[BufferHandle]
    pieces: _containers.RepeatedCompositeFieldContainer[SourcePiece]
    def __init__(self, key: _Optional[bytes] = ..., sources: _Optional[_Iterable[_Union[BufferHandle, _Mapping]]] = ..., pieces: _Optional[_Iterable[_Union[SourcePiece, _Mapping]]] = ...) -> None: ...

class BucketAck(_message.Message):
    __slots__ = ("version", "index", "ok", "error", "read_event")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    READ_EVENT_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: int
    ok: bool
    error: ErrorDetail
    read_event: bytes
    def __init__(self, version: _Optional[int] = ..., index: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., read_event: _Optional[bytes] = ...) -> None: ...

class VersionApplied(_message.Message):
    __slots__ = ("version", "ok", "error", "holds_base", "untouched", "acks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HOLDS_BASE_FIELD_NUMBER: _ClassVar[int]
    UNTOUCHED_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    ok: bool
    error: ErrorDetail
    holds_base: bool
    untouched: bool
    acks: _containers.RepeatedCompositeFieldContainer[BucketAck]
    def __init__(self, version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., holds_base: _Optional[bool] = ..., untouched: _Optional[bool] = ..., acks: _Optional[_Iterable[_Union[BucketAck, _Mapping]]] = ...) -> None: ...

class ReceiverMessage(_message.Message):
    __slots__ = ("hello", "verdict", "ack", "applied", "lane", "exported", "offer")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    hello: ReceiverHello
    verdict: ManifestVerdict
    ack: BucketAck
    applied: VersionApplied
    lane: LaneSwitch
    exported: BucketExported
    offer: WriteOffer
    def __init__(self, hello: _Optional[_Union[ReceiverHello, _Mapping]] = ..., verdict: _Optional[_Union[ManifestVerdict, _Mapping]] = ..., ack: _Optional[_Union[BucketAck, _Mapping]] = ..., applied: _Optional[_Union[VersionApplied, _Mapping]] = ..., lane: _Optional[_Union[LaneSwitch, _Mapping]] = ..., exported: _Optional[_Union[BucketExported, _Mapping]] = ..., offer: _Optional[_Union[WriteOffer, _Mapping]] = ...) -> None: ...

class BucketExported(_message.Message):
    __slots__ = ("version", "index", "ok", "error")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: int
    ok: bool
    error: ErrorDetail
    def __init__(self, version: _Optional[int] = ..., index: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class ReceiverWelcome(_message.Message):
    __slots__ = ("receiver_id", "lane", "keeps_keys", "takes_writes", "acks_in_applied")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    KEEPS_KEYS_FIELD_NUMBER: _ClassVar[int]
    TAKES_WRITES_FIELD_NUMBER: _ClassVar[int]
    ACKS_IN_APPLIED_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    lane: LaneOffer
    keeps_keys: bool
    takes_writes: bool
    acks_in_applied: bool
    def __init__(self, receiver_id: _Optional[str] = ..., lane: _Optional[_Union[LaneOffer, _Mapping]] = ..., keeps_keys: _Optional[bool] = ..., takes_writes: _Optional[bool] = ..., acks_in_applied: _Optional[bool] = ...) -> None: ...

class VersionStart(_message.Message):
    __slots__ = ("manifest", "num_buckets", "manifest_key")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_KEY_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    num_buckets: int
    manifest_key: bytes
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., num_buckets: _Optional[int] = ..., manifest_key: _Optional[bytes] = ...) -> None: ...

class BucketAnnouncement(_message.Message):
    __slots__ = ("version", "layout", "buffer", "group_id", "sources", "ready_event", "layout_key", "delta", "written")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    version: int
    layout: BucketLayout
    buffer: BufferHandle
    group_id: str
    sources: _containers.RepeatedCompositeFieldContainer[BufferHandle]
    ready_event: bytes
    layout_key: bytes
    delta: BucketDelta
    written: bool
    def __init__(self, version: _Optional[int] = ..., layout: _Optional[_Union[BucketLayout, _Mapping]] = ..., buffer: _Optional[_Union[BufferHandle, _Mapping]] = ..., group_id: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[BufferHandle, _Mapping]]] = ..., ready_event: _Optional[bytes] = ..., layout_key: _Optional[bytes] = ..., delta: _Optional[_Union[BucketDelta, _Mapping]] = ..., written: _Optional[bool] = ...) -> None: ...

class BucketDelta(_message.Message):
    __slots__ = ("form", "base_version", "base_checksum", "checksum", "nbytes", "count", "element_bytes")
    FORM_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    form: str
    base_version: int
    base_checksum: int
    checksum: int
    nbytes: int
    count: int
    element_bytes: int
    def __init__(self, form: _Optional[str] = ..., base_version: _Optional[int] = ..., base_checksum: _Optional[int] = ..., checksum: _Optional[int] = ..., nbytes: _Optional[int] = ..., count: _Optional[int] = ..., element_bytes: _Optional[int] = ...) -> None: ...

class GroupJoin(_message.Message):
    __slots__ = ("group_id", "store_host", "store_port", "rank", "world_size", "backend", "timeout_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class VersionEnd(_message.Message):
    __slots__ = ("version", "checksum_algorithm", "checksums")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum_algorithm: str
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., checksum_algorithm: _Optional[str] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class VersionAbort(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: ErrorDetail
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class Announcement(_message.Message):
    __slots__ = ("welcome", "start", "bucket", "end", "abort", "join", "batch", "lane", "export")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    welcome: ReceiverWelcome
    start: VersionStart
    bucket: BucketAnnouncement
    end: VersionEnd
    abort: VersionAbort
    join: GroupJoin
    batch: AnnouncementBatch
    lane: LaneSwitch
    export: PackBucket
    def __init__(self, welcome: _Optional[_Union[ReceiverWelcome, _Mapping]] = ..., start: _Optional[_Union[VersionStart, _Mapping]] = ..., bucket: _Optional[_Union[BucketAnnouncement, _Mapping]] = ..., end: _Optional[_Union[VersionEnd, _Mapping]] = ..., abort: _Optional[_Union[VersionAbort, _Mapping]] = ..., join: _Optional[_Union[GroupJoin, _Mapping]] = ..., batch: _Optional[_Union[AnnouncementBatch, _Mapping]] = ..., lane: _Optional[_Union[LaneSwitch, _Mapping]] = ..., export: _Optional[_Union[PackBucket, _Mapping]] = ...) -> None: ...

class AnnouncementBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Announcement]
    def __init__(self, items: _Optional[_Iterable[_Union[Announcement, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublisherStatus(_message.Message):
    __slots__ = ("publisher_id", "ranks_connected", "world_size", "device", "ranks_on_lanes")
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANKS_ON_LANES_FIELD_NUMBER: _ClassVar[int]
    publisher_id: str
    ranks_connected: int
    world_size: int
    device: str
    ranks_on_lanes: int
    def __init__(self, publisher_id: _Optional[str] = ..., ranks_connected: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., ranks_on_lanes: _Optional[int] = ...) -> None: ...

class ReceiverStatus(_message.Message):
    __slots__ = ("receiver_id", "engine", "rank", "device", "connected", "applied_version", "state", "last_error", "data_path", "kept_bytes", "lane", "catch_up")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    KEPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    engine: str
    rank: int
    device: str
    connected: bool
    applied_version: int
    state: str
    last_error: str
    data_path: str
    kept_bytes: int
    lane: bool
    catch_up: str
    def __init__(self, receiver_id: _Optional[str] = ..., engine: _Optional[str] = ..., rank: _Optional[int] = ..., device: _Optional[str] = ..., connected: _Optional[bool] = ..., applied_version: _Optional[int] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., data_path: _Optional[str] = ..., kept_bytes: _Optional[int] = ..., lane: _Optional[bool] = ..., catch_up: _Optional[str] = ...) -> None: ...

class ReceiverOutcome(_message.Message):
    __slots__ = ("receiver_id", "state", "error", "applied_at_unix_s", "direct_route_bytes", "written_buckets")
    class DirectRouteBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    DIRECT_ROUTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    state: str
    error: ErrorDetail
    applied_at_unix_s: float
    direct_route_bytes: _containers.ScalarMap[str, int]
    written_buckets: int
    def __init__(self, receiver_id: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., applied_at_unix_s: _Optional[float] = ..., direct_route_bytes: _Optional[_Mapping[str, int]] = ..., written_buckets: _Optional[int] = ...) -> None: ...

class VersionStatus(_message.Message):
    __slots__ = ("version", "state", "total_bytes", "num_tensors", "num_buckets", "started_at_unix_s", "staged_s", "complete_s", "receivers", "direct_bytes", "staged_bytes", "sender_packed", "route_bytes", "abandoned", "plan_s", "broadcast_bytes", "delta_buckets")
    class RouteBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STAGED_S_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_PACKED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    PLAN_S_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: str
    total_bytes: int
    num_tensors: int
    num_buckets: int
    started_at_unix_s: float
    staged_s: float
    complete_s: float
    receivers: _containers.RepeatedCompositeFieldContainer[ReceiverOutcome]
    direct_bytes: int
    staged_bytes: int
    sender_packed: bool
    route_bytes: _containers.ScalarMap[str, int]
    abandoned: ErrorDetail
    plan_s: float
    broadcast_bytes: int
    delta_buckets: int
    def __init__(self, version: _Optional[int] = ..., state: _Optional[str] = ..., total_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_buckets: _Optional[int] = ..., started_at_unix_s: _Optional[float] = ..., staged_s: _Optional[float] = ..., complete_s: _Optional[float] = ..., receivers: _Optional[_Iterable[_Union[ReceiverOutcome, _Mapping]]] = ..., direct_bytes: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., sender_packed: _Optional[bool] = ..., route_bytes: _Optional[_Mapping[str, int]] = ..., abandoned: _Optional[_Union[ErrorDetail, _Mapping]] = ..., plan_s: _Optional[float] = ..., broadcast_bytes: _Optional[int] = ..., delta_buckets: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("sender_version", "transport", "bucket_size_bytes", "num_buffers", "publishers", "receivers", "versions", "catch_ups")
    SENDER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHERS_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UPS_FIELD_NUMBER: _ClassVar[int]
    sender_version: str
    transport: str
    bucket_size_bytes: int
    num_buffers: int
    publishers: _containers.RepeatedCompositeFieldContainer[PublisherStatus]
    receivers: _containers.RepeatedCompositeFieldContainer[ReceiverStatus]
    versions: _containers.RepeatedCompositeFieldContainer[VersionStatus]
    catch_ups: _containers.RepeatedCompositeFieldContainer[CatchUpStatus]
    def __init__(self, sender_version: _Optional[str] = ..., transport: _Optional[str] = ..., bucket_size_bytes: _Optional[int] = ..., num_buffers: _Optional[int] = ..., publishers: _Optional[_Iterable[_Union[PublisherStatus, _Mapping]]] = ..., receivers: _Optional[_Iterable[_Union[ReceiverStatus, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[VersionStatus, _Mapping]]] = ..., catch_ups: _Optional[_Iterable[_Union[CatchUpStatus, _Mapping]]] = ...) -> None: ...

class CatchUpStatus(_message.Message):
    __slots__ = ("receiver_id", "version", "source", "state", "bytes", "started_at_unix_s", "complete_s", "error", "route")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    version: int
    source: str
    state: str
    bytes: int
    started_at_unix_s: float
    complete_s: float
    error: ErrorDetail
    route: str
    def __init__(self, receiver_id: _Optional[str] = ..., version: _Optional[int] = ..., source: _Optional[str] = ..., state: _Optional[str] = ..., bytes: _Optional[int] = ..., started_at_unix_s: _Optional[float] = ..., complete_s: _Optional[float] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., route: _Optional[str] = ...) -> None: ...

class WaitAppliedRequest(_message.Message):
    __slots__ = ("version", "timeout_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    timeout_s: float
    def __init__(self, version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitAppliedReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: VersionStatus
    def __init__(self, version: _Optional[_Union[VersionStatus, _Mapping]] = ...) -> None: ...
