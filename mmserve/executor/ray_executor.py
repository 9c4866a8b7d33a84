"""Workers as Ray actors, one per tensor-parallel rank, placed by a placement group so one
engine spans the nodes of a Ray cluster (`ray start --head` on one machine, `ray start
--address ...` on the others; the engine connects to it through RAY_ADDRESS or starts a local one).

Each step the scheduler output is pickled once and put into Ray's object store once; every actor
gets the same object. Rank 0 alone returns the sampled tokens. An actor that dies (or raises)
makes the executor dead (`ExecutorDeadError`); `shutdown` kills the actors and frees the group.
The ranks meet in torch.distributed through a TCPStore that this process hosts on its node's
address (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from mmserve.config import EngineConfig
from mmserve.core.sched_output import ExecutorDeadError, ModelRunnerOutput, SchedulerOutput
from mmserve.distributed.parallel_state import DistributedInit, host_store
from mmserve.executor.abstract import Executor
from mmserve.executor.worker_factory import build_worker, distributed_backend, on_cuda
from mmserve.openmp_env import child_settings

POLL_S = 0.1  # how often a wait checks every actor


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'mmserve[ray]'") from None
    return ray


class RayWorker:
    """The actor: one rank's worker, built on the node Ray placed it on."""

    def start(self, config: EngineConfig, distributed_init: DistributedInit) -> str:
        import ray

        self.worker = build_worker(config, distributed_init)
        return ray.get_runtime_context().get_node_id()

    def execute(self, payload: bytes) -> bytes | None:
        output = self.worker.execute_model(pickle.loads(payload))
        return pickle.dumps(output, protocol=5) if self.worker.rank == 0 else None

    def ping(self) -> None:
        """Answers at once (between steps): the executor's health check."""

    def rpc(self, method: str, args: tuple) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init()
        self.world_size = config.parallel.world_size
        gpus = 1 if on_cuda(config) else 0
        bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        self.placement_group = placement_group([bundle] * self.world_size, strategy="PACK")
        self.actors: list[Any] = []
        self._closed = False
        try:
            ray.get(self.placement_group.ready(), timeout=300)
            host = ray.util.get_node_ip_address()
            self._store = host_store(host)
            actor_class = ray.remote(num_cpus=1, num_gpus=gpus)(RayWorker)
            runtime_env = self._worker_runtime_env()
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                )
                options = {"scheduling_strategy": strategy, **runtime_env}
                self.actors.append(actor_class.options(**options).remote())
            backend = distributed_backend(config)
            self.node_ids = self._get_all(
                [
                    actor.start.remote(
                        config, DistributedInit(host, self._store.port, rank, self.world_size, backend)
                    )
                    for rank, actor in enumerate(self.actors)
                ]
            )
            self.num_blocks = min(self.collective_rpc("determine_num_blocks"))
            self.collective_rpc("initialize_kv_cache", self.num_blocks)
        except BaseException:
            self.shutdown()
            raise

    def _worker_runtime_env(self) -> dict[str, Any]:
        """The actors' runtime_env option: the OpenMP spin count of mmserve.openmp_env, which Ray
        sets as it starts the actor's process (a runtime_env of its own gets a fresh one, not a
        pooled worker whose OpenMP has read its environment already), unless the user chose one
        here or in the job's runtime_env."""
        job_env = self._ray.get_runtime_context().runtime_env.get("env_vars") or {}
        env_vars = child_settings({**os.environ, **job_env})
        return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}

    def _get_all(self, refs: list[Any]) -> list[Any]:
        """Every result, in order; the first failure (an actor died or raised) ends the wait."""
        ray = self._ray
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:
                    raise ExecutorDeadError(f"a Ray worker failed: {type(e).__name__}: {e}") from None
        return ray.get(refs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._closed:
            raise ExecutorDeadError("the executor is shut down")
        payload = pickle.dumps(scheduler_output, protocol=5)
        self.last_step_bytes = len(payload)
        self.total_step_bytes += self.last_step_bytes
        ref = self._ray.put(payload)  # once, whatever the number of actors
        results = self._get_all([actor.execute.remote(ref) for actor in self.actors])
        return pickle.loads(results[0])

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._closed:
            raise ExecutorDeadError("the executor is shut down")
        return self._get_all([actor.rpc.remote(method, args) for actor in self.actors])

    def check_health(self) -> None:
        """Ask every actor for nothing, briefly: one that died answers with an error."""
        if not self._closed:
            self._get_all([actor.ping.remote() for actor in self.actors])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for actor in self.actors:
            self._ray.kill(actor)
        self._remove_placement_group(self.placement_group)
        self._store = None
        if self._started_ray:
            self._ray.shutdown()
