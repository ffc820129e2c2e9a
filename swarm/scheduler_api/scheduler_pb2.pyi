from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AssignmentRequest(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("assigned", "start", "end", "epoch", "policy", "retry_after", "reason", "role")
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    assigned: bool
    start: int
    end: int
    epoch: int
    policy: str
    retry_after: float
    reason: str
    role: str
    def __init__(self, assigned: _Optional[bool] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., epoch: _Optional[int] = ..., policy: _Optional[str] = ..., retry_after: _Optional[float] = ..., reason: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class ServerRtt(_message.Message):
    __slots__ = ("peer_id", "rtt")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    rtt: float
    def __init__(self, peer_id: _Optional[str] = ..., rtt: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("client_id", "rtts", "l_in", "l_out", "batch_size", "max_length", "task", "pushed")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RTTS_FIELD_NUMBER: _ClassVar[int]
    L_IN_FIELD_NUMBER: _ClassVar[int]
    L_OUT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    rtts: _containers.RepeatedCompositeFieldContainer[ServerRtt]
    l_in: int
    l_out: int
    batch_size: int
    max_length: int
    task: str
    pushed: bool
    def __init__(self, client_id: _Optional[str] = ..., rtts: _Optional[_Iterable[_Union[ServerRtt, _Mapping]]] = ..., l_in: _Optional[int] = ..., l_out: _Optional[int] = ..., batch_size: _Optional[int] = ..., max_length: _Optional[int] = ..., task: _Optional[str] = ..., pushed: _Optional[bool] = ...) -> None: ...

class Hop(_message.Message):
    __slots__ = ("peer_id", "start", "end")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    start: int
    end: int
    def __init__(self, peer_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("session_id", "chain", "admitted", "expected_wait", "expected_completion", "cost", "lease", "epoch", "error", "slo_miss", "slo_reason", "expected_ttft", "prefill", "prefill_planned")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WAIT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COMPLETION_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SLO_MISS_FIELD_NUMBER: _ClassVar[int]
    SLO_REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TTFT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PLANNED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    chain: _containers.RepeatedCompositeFieldContainer[Hop]
    admitted: bool
    expected_wait: float
    expected_completion: float
    cost: float
    lease: float
    epoch: int
    error: str
    slo_miss: bool
    slo_reason: str
    expected_ttft: float
    prefill: _containers.RepeatedCompositeFieldContainer[Hop]
    prefill_planned: bool
    def __init__(self, session_id: _Optional[str] = ..., chain: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., admitted: _Optional[bool] = ..., expected_wait: _Optional[float] = ..., expected_completion: _Optional[float] = ..., cost: _Optional[float] = ..., lease: _Optional[float] = ..., epoch: _Optional[int] = ..., error: _Optional[str] = ..., slo_miss: _Optional[bool] = ..., slo_reason: _Optional[str] = ..., expected_ttft: _Optional[float] = ..., prefill: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., prefill_planned: _Optional[bool] = ...) -> None: ...

class AwaitRequest(_message.Message):
    __slots__ = ("session_id", "timeout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    timeout: float
    def __init__(self, session_id: _Optional[str] = ..., timeout: _Optional[float] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "ttft", "tpot", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttft: float
    tpot: float
    tokens: int
    def __init__(self, session_id: _Optional[str] = ..., ttft: _Optional[float] = ..., tpot: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("known", "lease")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    lease: float
    def __init__(self, known: _Optional[bool] = ..., lease: _Optional[float] = ...) -> None: ...

class EndReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("peer_id", "public_name", "state", "managed", "start", "end", "assigned_start", "assigned_end", "memory_bytes", "tau", "tau_prefill", "cache_slots", "slots_in_use", "active_sessions", "reachability")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MANAGED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_START_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_END_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    TAU_PREFILL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    public_name: str
    state: str
    managed: bool
    start: int
    end: int
    assigned_start: int
    assigned_end: int
    memory_bytes: float
    tau: float
    tau_prefill: float
    cache_slots: int
    slots_in_use: int
    active_sessions: int
    reachability: str
    def __init__(self, peer_id: _Optional[str] = ..., public_name: _Optional[str] = ..., state: _Optional[str] = ..., managed: _Optional[bool] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., assigned_start: _Optional[int] = ..., assigned_end: _Optional[int] = ..., memory_bytes: _Optional[float] = ..., tau: _Optional[float] = ..., tau_prefill: _Optional[float] = ..., cache_slots: _Optional[int] = ..., slots_in_use: _Optional[int] = ..., active_sessions: _Optional[int] = ..., reachability: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("policy", "epoch", "num_blocks", "num_requests", "bound", "arrival_rate", "servers", "coverage", "active_sessions", "waiting_sessions", "uncovered_blocks", "plan_input", "plan_output", "uptime", "finished_requests", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "wait_p50", "wait_p95", "status_url")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    UNCOVERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PLAN_INPUT_FIELD_NUMBER: _ClassVar[int]
    PLAN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_FIELD_NUMBER: _ClassVar[int]
    TPOT_P50_FIELD_NUMBER: _ClassVar[int]
    TPOT_P95_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_FIELD_NUMBER: _ClassVar[int]
    WAIT_P95_FIELD_NUMBER: _ClassVar[int]
    STATUS_URL_FIELD_NUMBER: _ClassVar[int]
    policy: str
    epoch: int
    num_blocks: int
    num_requests: int
    bound: float
    arrival_rate: float
    servers: _containers.RepeatedCompositeFieldContainer[ServerStatus]
    coverage: _containers.RepeatedScalarFieldContainer[int]
    active_sessions: int
    waiting_sessions: int
    uncovered_blocks: _containers.RepeatedScalarFieldContainer[int]
    plan_input: str
    plan_output: str
    uptime: float
    finished_requests: int
    ttft_p50: float
    ttft_p95: float
    tpot_p50: float
    tpot_p95: float
    wait_p50: float
    wait_p95: float
    status_url: str
    def __init__(self, policy: _Optional[str] = ..., epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., bound: _Optional[float] = ..., arrival_rate: _Optional[float] = ..., servers: _Optional[_Iterable[_Union[ServerStatus, _Mapping]]] = ..., coverage: _Optional[_Iterable[int]] = ..., active_sessions: _Optional[int] = ..., waiting_sessions: _Optional[int] = ..., uncovered_blocks: _Optional[_Iterable[int]] = ..., plan_input: _Optional[str] = ..., plan_output: _Optional[str] = ..., uptime: _Optional[float] = ..., finished_requests: _Optional[int] = ..., ttft_p50: _Optional[float] = ..., ttft_p95: _Optional[float] = ..., tpot_p50: _Optional[float] = ..., tpot_p95: _Optional[float] = ..., wait_p50: _Optional[float] = ..., wait_p95: _Optional[float] = ..., status_url: _Optional[str] = ...) -> None: ...
