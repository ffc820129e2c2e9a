"""The server's attention-cache budget (eq. 2, docs/reference.md 2): `s_m*m_j + s_c*sum_r k_j^r <= M_j`.

Blocks take their bytes once at start-up; every session reserves its whole cache (all positions up
to its `max_length`, for each block it processes) at open time and gives it back when it ends, on
every path. A session that does not fit is refused up front instead of failing half-way.
"""

from __future__ import annotations

from llm_swarm.swarm.errors import SwarmUserError


class NoCacheRoom(Exception):
    """Not enough cache memory left right now; the client should wait or route elsewhere."""


class CacheBudget:
    def __init__(self, memory_bytes: int, blocks_bytes: int):
        if blocks_bytes > memory_bytes:
            raise SwarmUserError(
                f"the memory budget ({memory_bytes:,} bytes) is smaller than the blocks themselves "
                f"({blocks_bytes:,} bytes): raise --memory or serve fewer blocks"
            )
        self.memory_bytes = memory_bytes
        self.total_bytes = memory_bytes - blocks_bytes
        self._reserved: dict[str, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._reserved.values())

    @property
    def bytes_left(self) -> int:
        return self.total_bytes - self.used_bytes

    def reserve(self, owner: str, num_bytes: int) -> None:
        if owner in self._reserved:
            raise ValueError(f"{owner} already holds a reservation")
        if num_bytes > self.bytes_left:
            raise NoCacheRoom(
                f"no cache room: the session needs {num_bytes:,} bytes of attention cache, "
                f"{self.bytes_left:,} of {self.total_bytes:,} are free"
            )
        self._reserved[owner] = num_bytes

    def release(self, owner: str) -> None:
        self._reserved.pop(owner, None)

    def slots_left(self, bytes_per_slot: int) -> int:
        return self.bytes_left // bytes_per_slot if bytes_per_slot > 0 else 0
