"""How the engine spreads over devices and processes (ParallelConfig, requested): a ("dp", "tp")
mesh of data_parallel_size replicas, each its own scheduler and KV pool, of tensor_parallel_size
devices each (jaxserve/runtime/sharding.py), a mixture of experts' experts replicated on them or,
with enable_expert_parallel, spread over them; several processes (hosts) join as one engine
(jaxserve/runtime/distributed.py), process 0 scheduling and every process running each step."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import option


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = option(
        1, "Devices each replica's weights and KV heads are sharded over.")
    enable_expert_parallel: bool = option(
        False, "A mixture of experts' experts spread over the tensor-parallel devices (each "
        "holds num_experts / tensor_parallel_size whole experts; attention stays tensor "
        "parallel), not replicated on each. No effect on a dense model or on one device.")
    data_parallel_size: int = option(
        1, "Engine replicas, each with its own scheduler, KV pool and devices.")
    coordinator_address: str | None = option(
        None, "host:port of process 0, to join several processes (hosts) as one engine.")
    num_processes: int = option(1, "Processes joined as one engine.")
    process_id: int = option(
        0, "This process's index; 0 schedules and serves, the others follow it.")
    distributed_timeout_s: int = option(
        60, "Seconds to wait for every process to join; a peer silent for a sixth of this ends "
        "the run with an error.")

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            n = getattr(self, name)
            if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError("enable_expert_parallel must be True or False, got "
                             f"{self.enable_expert_parallel!r}")
        if not (isinstance(self.num_processes, int) and self.num_processes >= 1):
            raise ValueError(f"num_processes must be an integer >= 1, got {self.num_processes!r}")
        if not (isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes):
            raise ValueError(f"process_id must be in 0..{self.num_processes - 1}, got "
                             f"{self.process_id!r}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
        t = self.distributed_timeout_s
        if not (isinstance(t, int) and t >= 1):
            raise ValueError(f"distributed_timeout_s must be an integer >= 1, got {t!r}")
        if self.num_processes > 1 and self.data_parallel_size != 1:
            raise ValueError("several processes serve one tensor-parallel engine; "
                             "data_parallel_size must be 1")
