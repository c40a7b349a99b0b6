"""The pull transport (`backend: nixl`, docs/nixl.md) in the planner: one-sided reads, not a broadcast.

Each receiver GPU reads the bytes it needs straight out of the senders' registered slots over its
own link (its NIC, or NVLink inside a node). There is no ring and no tree: no fill per hop, but no
fan-out either, so a sender's link carries its bytes once per receiver that reads them. The
transfer is therefore bounded by the larger of

* receiver ingress: the bytes one GPU takes in (every byte with ``receive=full``, its 1/N with
  receive plans, in waves of ``parallel_sets`` sets as on every transport) over its own link;
* sender egress: each sender's bytes times the number of receivers reading them, over its link
  (``full``: every rollout GPU; ``shard``: each engine reads a sender's bytes once in all);

plus, per bucket, the sender's look at the rendezvous store for the receivers' ``free`` (every
1 ms) and one store round trip per reader (their ``free`` keys are deleted one by one). Every bucket is
packed into a registered slot, so the sender always pays the pack copy. Delta frames are not
carried (the transport refuses ``delta: on``).

Not per sync: a process's first NIXL agent (UCX start) and the registration of its slots and the
exchange of offers, once per plan (`first_sync_s`).

What is measured and what is modelled: no GPU run of nixl has happened. The link efficiencies are
the broadcast's (on the CPU box a raw pull of the 7B bytes ran at 1.1 x gloo's raw broadcast,
bench/RESULTS.md); ``nixl_agent_start_s`` is the CPU box's figure; ``nixl_bucket_s`` and
``nixl_plan_s`` and ``nixl_store_op_s`` are assumed (`params.ASSUMED`). Not modelled: the one store
server taking every sender's and receiver's keys (at 256 x 256 ranks, ~130,000 operations per
round of buckets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt_engine.plan.cluster import Links, RolloutLayout
from ckpt_engine.plan.params import Calibration

__all__ = ["PullTransfer", "first_sync_s", "pull_link_gbs", "pull_transfer"]


@dataclass(frozen=True)
class PullTransfer:
    """Seconds of one sync's pulls: the total and its two bandwidth bounds."""

    seconds: float
    ingress_s: float
    egress_s: float
    link_gbs: float
    """The rate one pull should achieve (GB/s): what the rate guardrail's ``min_gbps`` compares with."""


def pull_link_gbs(links: Links, cal: Calibration, nvlink: bool) -> float:
    """GB/s one one-sided read stream gets over one GPU's link (NVLink inside a node, else its NIC)."""
    return links.nvlink_gbs * cal.nvlink_eff if nvlink else links.nic_gbs * cal.nic_eff


def pull_transfer(
    wire: float, senders: int, buckets: int, receive: str, rollout: RolloutLayout, links: Links, parallel_sets: int, cal: Calibration,
) -> PullTransfer:
    """One sync's reads: ``wire`` bytes held by ``senders`` ranks, read by every rollout GPU."""
    gbs = pull_link_gbs(links, cal, nvlink=links.same_node)
    rate = gbs * 1e9
    if receive == "shard":
        waves = math.ceil(rollout.gpus_per_engine / parallel_sets)
        ingress_s = waves * wire / rollout.gpus_per_engine / rate
        readers = rollout.num_engines  # each engine reads a sender's bytes once, spread over its GPUs
    else:
        waves = 1
        ingress_s = wire / rate
        readers = rollout.num_gpus  # every GPU reads every byte of every sender
    egress_s = readers * wire / senders / rate
    seconds = max(ingress_s, egress_s) + (buckets + waves) * (cal.nixl_bucket_s + readers * cal.nixl_store_op_s)
    return PullTransfer(seconds, ingress_s, egress_s, gbs)


def first_sync_s(cal: Calibration, fresh_process: bool = True) -> float:
    """What the first sync of a plan pays on top: registering the slots and exchanging offers, and,
    in a process that has no NIXL agent yet, starting one (UCX)."""
    return cal.nixl_plan_s + (cal.nixl_agent_start_s if fresh_process else 0.0)
