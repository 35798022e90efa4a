"""Scale a model's replicas on queue depth: waiting requests per replica, not CPU utilisation.

Ray Serve's default policy targets *ongoing* requests per replica (running + queued). An LLM replica runs
up to max_num_seqs requests in one batch at little extra cost per request, so ongoing requests say little
about whether it is overloaded; requests that wait do. This policy runs in Ray Serve's controller as a
custom autoscaling policy (AutoscalingConfig.policy) and sees:

  - each replica's engine queue (kvserve's own count of requests submitted but not yet running), and its
    running requests and batch slots, reported by ModelReplica.record_autoscaling_stats;
  - Ray Serve's count of requests queued at the handles (the ingress), not yet given to any replica: a
    replica takes at most max_num_seqs + ceil(target_queue_depth) requests, the rest wait there, so that
    a new replica can take them.

    waiting = sum of engine queues + handle queue        (averaged over Ray's look-back window)
    desired = max(waiting / target_queue_depth, running / batch_slots)

The first term is Ray's default formula (total metric / target per replica) with "ongoing" replaced by
"waiting": more than target_queue_depth waiting per replica scales up. The second keeps the replicas the
running requests need, so a load that fits without waiting does not scale down (and then up again when
the queue reappears). Ray applies min/max_replicas, upscale_delay_s and downscale_delay_s around it.

This module is pickled by value into the controller: it imports nothing but the standard library."""
from __future__ import annotations

import math
from typing import Any

WAITING_METRIC = "kvserve_waiting"        # requests in the engine's queue (and in flight to it)
RUNNING_METRIC = "kvserve_running"        # requests in the engine's batch
BATCH_SLOTS_METRIC = "kvserve_batch_slots"  # max_num_seqs: how many may run at once


def desired_replicas(waiting: float, running: float, batch_slots: float | None, target_queue_depth: float) -> float:
    """Replicas that keep at most target_queue_depth requests waiting per replica, and that the running
    requests fit in. Not rounded or bounded: Ray does that."""
    by_queue = waiting / target_queue_depth
    by_batch = running / batch_slots if batch_slots else 0.0
    return max(by_queue, by_batch)


class QueueDepthPolicy:
    """Ray Serve custom autoscaling policy (a class: Ray builds it once with policy_kwargs and calls it
    with an AutoscalingContext on every control-loop tick)."""

    def __init__(self, target_queue_depth: float) -> None:
        self.target_queue_depth = target_queue_depth

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        metrics = ctx.aggregated_metrics or {}
        waiting = sum(metrics.get(WAITING_METRIC, {}).values()) + (ctx.total_queued_requests or 0.0)
        running = sum(metrics.get(RUNNING_METRIC, {}).values())
        slots = max(metrics.get(BATCH_SLOTS_METRIC, {}).values(), default=None)
        desired = desired_replicas(waiting, running, slots, self.target_queue_depth)
        return math.ceil(desired - 1e-9), {}  # averaged metrics: 2.0000001 waiting-units is still 2
