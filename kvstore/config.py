"""Configuration of one kvstore node (a pydantic model; the node's CLI fills it)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field, model_validator

MIN_EVENTS = 4096  # the event log's least default length


class EvictionKind(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"
    LENGTH = "length"


class StoreConfig(BaseModel):
    """Sizes, policies and timeouts of a pool node's block store."""

    node: str = Field("kv0", min_length=1, description="node name (unique in the cluster)")
    block_bytes: int = Field(gt=0, description="bytes of one block's KV (DESIGN §4 layout); one value cluster-wide")
    dram_blocks: int = Field(gt=0, description="slots in the DRAM tier")
    ssd_dir: str | None = Field(None, description="directory of the SSD tier's slot files (none: no SSD tier)")
    ssd_blocks: int = Field(0, ge=0, description="slots in the SSD tier")
    ssd_file_blocks: int = Field(1024, gt=0, description="slots per SSD file")
    ssd_fsync: bool = Field(False, description="fsync each SSD write (survives power loss, not only kill -9)")
    eviction: EvictionKind = Field(EvictionKind.LRU, description="eviction policy")
    high_watermark: float = Field(0.95, gt=0, le=1, description="DRAM use that triggers background eviction")
    low_watermark: float = Field(0.85, gt=0, le=1, description="DRAM use that eviction brings it back to")
    lease_ttl_s: float = Field(30.0, gt=0, description="default lease lifetime when a get names none")
    reservation_ttl_s: float = Field(30.0, gt=0, description="an uncommitted put is aborted after this long")
    max_events: int | None = Field(
        None,
        gt=0,
        description="events kept for subscribers that fall behind (default: as many as the node holds blocks, "
        f"{MIN_EVENTS} at least: a subscriber further behind gets a snapshot, which costs no more than those events)",
    )

    @property
    def events_kept(self) -> int:
        return self.max_events or max(MIN_EVENTS, self.dram_blocks + self.ssd_blocks)

    @model_validator(mode="after")
    def _check(self) -> "StoreConfig":
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must not exceed high_watermark")
        if (self.ssd_dir is None) != (self.ssd_blocks == 0):
            raise ValueError("ssd_dir and ssd_blocks > 0 go together (both set for an SSD tier, neither without)")
        return self
