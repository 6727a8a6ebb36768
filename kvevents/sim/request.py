"""An engine request: prompt, generated tokens, block table, progress and timing."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvevents.sim.hashing import extend_hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a CPU-tier load is in flight
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestResult:
    """A finished request as ``PagedEngine.step()`` reports it (times are simulated)."""

    request_id: str
    arrival_time: float
    first_token_time: float
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_gpu_cached_tokens: int  # prompt tokens served by the GPU prefix cache
    num_cpu_loaded_tokens: int  # prompt tokens loaded from the CPU tier
    output_token_ids: list[int]

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_gpu_cached_tokens - self.num_cpu_loaded_tokens


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_new_tokens: int,
        arrival_time: float,
        block_size: int,
        lora_name: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self._tokens = list(prompt_token_ids)
        self.max_new_tokens = max_new_tokens
        self.arrival_time = arrival_time
        self.lora_name = lora_name
        self.block_size = block_size
        # LoRA adapters namespace blocks: same tokens under another adapter differ.
        self.block_extra_keys: Any = (lora_name,) if lora_name is not None else None
        self._hashes: list[int] = []
        extend_hashes(self._hashes, self._tokens, block_size, self.block_extra_keys)
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0  # blocks already registered in the GPU prefix cache
        self.num_gpu_cached_tokens = 0
        self.num_cpu_loaded_tokens = 0
        self.pending_external_tokens = 0
        self.first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self._tokens

    @property
    def block_hashes(self) -> list[int]:
        return self._hashes

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self._tokens) - self.num_prompt_tokens

    def append_token(self, token: int) -> None:
        self._tokens.append(token)
        extend_hashes(self._hashes, self._tokens, self.block_size, self.block_extra_keys)

    def blocks_needed(self) -> int:
        """Blocks this request can ever occupy (prompt + all generated tokens)."""
        total = self.num_prompt_tokens + self.max_new_tokens
        return -(-total // self.block_size)
