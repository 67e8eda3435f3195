"""Fan a list of independent shards out over Ray actors, one actor per worker slot, and survive workers dying.

    run_on_ray(ShardWorker, (job,), shards=[0, 1, 2, 3], workers=2, on_done=lambda shard, result: ...)

Each actor is built once (``worker_cls(*init_args)``, e.g. loading a model) and then serves ``run(shard)`` calls.
An actor whose process dies is restarted by Ray and the interrupted call retried (``max_restarts`` /
``max_task_retries``); an actor that keeps dying is replaced and its shard requeued. An exception raised *inside*
``run`` is a bug, not a crash, and propagates to the caller. ``address=None`` starts a local Ray for the call and
shuts it down afterwards; ``address="auto"`` or ``"ray://host:10001"`` joins an existing cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

RESTARTS = 2  # per actor, before it is replaced by a fresh one


def run_on_ray(
    worker_cls: type,
    init_args: tuple,
    shards: Sequence[int],
    workers: int,
    on_done: Callable[[int, Any], None],
    *,
    address: str | None = None,
    gpus_per_worker: float = 0,
    cpus_per_worker: float = 1,
) -> None:
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level="WARNING")
    try:
        actor_cls = ray.remote(
            num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=RESTARTS, max_task_retries=RESTARTS
        )(worker_cls)
        idle = [actor_cls.remote(*init_args) for _ in range(max(1, min(workers, len(shards))))]
        queue = list(shards)
        running: dict[Any, tuple[Any, int]] = {}
        while queue or running:
            while queue and idle:
                actor, shard = idle.pop(), queue.pop(0)
                running[actor.run.remote(shard)] = (actor, shard)
            (ref,), _ = ray.wait(list(running), num_returns=1)
            actor, shard = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError:
                # the actor died more often than Ray restarts it: replace it and give its shard to the next free one
                ray.kill(actor, no_restart=True)
                actor = actor_cls.remote(*init_args)
                queue.insert(0, shard)
            else:
                on_done(shard, result)
            idle.append(actor)
    finally:
        if started_here:
            ray.shutdown()
