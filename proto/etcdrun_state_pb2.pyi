from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    JOINING: _ClassVar[Phase]
    FROZEN: _ClassVar[Phase]
    CLOSED: _ClassVar[Phase]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    SUCCEEDED: _ClassVar[Outcome]
    FAILED: _ClassVar[Outcome]
    ABORTED: _ClassVar[Outcome]
    CANCELLED: _ClassVar[Outcome]
PHASE_UNSPECIFIED: Phase
JOINING: Phase
FROZEN: Phase
CLOSED: Phase
OUTCOME_UNSPECIFIED: Outcome
SUCCEEDED: Outcome
FAILED: Outcome
ABORTED: Outcome
CANCELLED: Outcome

class AgentInfo(_message.Message):
    __slots__ = ("schema_version", "node_id", "host", "addr", "pid", "local_world_size", "version", "started_unix_ms", "lease_id", "min_nodes", "max_nodes", "max_restarts", "leaving", "protocol", "spare_port")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SPARE_PORT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    node_id: str
    host: str
    addr: str
    pid: int
    local_world_size: int
    version: str
    started_unix_ms: int
    lease_id: int
    min_nodes: int
    max_nodes: int
    max_restarts: int
    leaving: str
    protocol: int
    spare_port: int
    def __init__(self, schema_version: _Optional[int] = ..., node_id: _Optional[str] = ..., host: _Optional[str] = ..., addr: _Optional[str] = ..., pid: _Optional[int] = ..., local_world_size: _Optional[int] = ..., version: _Optional[str] = ..., started_unix_ms: _Optional[int] = ..., lease_id: _Optional[int] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., max_restarts: _Optional[int] = ..., leaving: _Optional[str] = ..., protocol: _Optional[int] = ..., spare_port: _Optional[int] = ...) -> None: ...

class JoinRecord(_message.Message):
    __slots__ = ("schema_version", "node_id", "addr", "local_world_size", "master_port", "agent_create_revision", "host", "pid")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    AGENT_CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    node_id: str
    addr: str
    local_world_size: int
    master_port: int
    agent_create_revision: int
    host: str
    pid: int
    def __init__(self, schema_version: _Optional[int] = ..., node_id: _Optional[str] = ..., addr: _Optional[str] = ..., local_world_size: _Optional[int] = ..., master_port: _Optional[int] = ..., agent_create_revision: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class Participant(_message.Message):
    __slots__ = ("node_id", "node_rank", "local_world_size", "addr", "first_global_rank", "host", "pid", "held_from")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    FIRST_GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HELD_FROM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_rank: int
    local_world_size: int
    addr: str
    first_global_rank: int
    host: str
    pid: int
    held_from: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., addr: _Optional[str] = ..., first_global_rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., held_from: _Optional[_Iterable[int]] = ...) -> None: ...

class ParticipantList(_message.Message):
    __slots__ = ("participants",)
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    participants: _containers.RepeatedCompositeFieldContainer[Participant]
    def __init__(self, participants: _Optional[_Iterable[_Union[Participant, _Mapping]]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("node_id", "host", "global_rank", "exit_code", "signal_name", "message", "timestamp_ms", "traceback", "local_rank", "pid", "stderr_tail")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    global_rank: int
    exit_code: int
    signal_name: str
    message: str
    timestamp_ms: int
    traceback: str
    local_rank: int
    pid: int
    stderr_tail: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., global_rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal_name: _Optional[str] = ..., message: _Optional[str] = ..., timestamp_ms: _Optional[int] = ..., traceback: _Optional[str] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., stderr_tail: _Optional[_Iterable[str]] = ...) -> None: ...

class RoundState(_message.Message):
    __slots__ = ("schema_version", "number", "phase", "participants", "master_addr", "master_port", "restart_count", "last_call_deadline_unix_ms", "reason", "decided_by", "outcome", "failure", "world_size", "closed_unix_ms", "run_lease", "departed", "arrived", "departed_cause", "last_call_joined", "participants_zlib", "carried", "protocol", "shards", "node_count")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_LEASE_FIELD_NUMBER: _ClassVar[int]
    DEPARTED_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    DEPARTED_CAUSE_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_JOINED_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_ZLIB_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    number: int
    phase: Phase
    participants: _containers.RepeatedCompositeFieldContainer[Participant]
    master_addr: str
    master_port: int
    restart_count: int
    last_call_deadline_unix_ms: int
    reason: str
    decided_by: str
    outcome: Outcome
    failure: Failure
    world_size: int
    closed_unix_ms: int
    run_lease: int
    departed: _containers.RepeatedScalarFieldContainer[str]
    arrived: _containers.RepeatedScalarFieldContainer[str]
    departed_cause: _containers.RepeatedScalarFieldContainer[str]
    last_call_joined: int
    participants_zlib: bytes
    carried: bool
    protocol: int
    shards: int
    node_count: int
    def __init__(self, schema_version: _Optional[int] = ..., number: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., participants: _Optional[_Iterable[_Union[Participant, _Mapping]]] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., restart_count: _Optional[int] = ..., last_call_deadline_unix_ms: _Optional[int] = ..., reason: _Optional[str] = ..., decided_by: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., world_size: _Optional[int] = ..., closed_unix_ms: _Optional[int] = ..., run_lease: _Optional[int] = ..., departed: _Optional[_Iterable[str]] = ..., arrived: _Optional[_Iterable[str]] = ..., departed_cause: _Optional[_Iterable[str]] = ..., last_call_joined: _Optional[int] = ..., participants_zlib: _Optional[bytes] = ..., carried: bool = ..., protocol: _Optional[int] = ..., shards: _Optional[int] = ..., node_count: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("schema_version", "node_id", "by", "requested_unix_ms", "forced")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    node_id: str
    by: str
    requested_unix_ms: int
    forced: bool
    def __init__(self, schema_version: _Optional[int] = ..., node_id: _Optional[str] = ..., by: _Optional[str] = ..., requested_unix_ms: _Optional[int] = ..., forced: bool = ...) -> None: ...
