"""Prefix affinity for ``lmdock serve --replicas`` (Ray Serve's public request-router API): a request
whose prompt shares its first ``PREFIX_TOKENS`` tokens with earlier ones goes to the replica that ran
them, whose prefix cache holds those tokens.

The replica is chosen by rendezvous hashing of the prefix over the replicas' ids, so it needs no
shared table and a replica coming or going moves only its own prefixes.  When that replica is full
(``max_ongoing_requests``) the others take the request; a shorter prompt goes to the less loaded of
two replicas picked at random (Ray Serve's default).  A module of its own because Ray Serve imports
the router by its path, and it imports Ray, which only ``--replicas`` needs.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

#: prompts sharing this many leading tokens go to the same replica
PREFIX_TOKENS = 32


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        ids = (getattr(request, "prompt_token_ids", None) or ())[:PREFIX_TOKENS]
        if len(ids) < PREFIX_TOKENS or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        key = ",".join(map(str, ids))

        def weight(replica: RunningReplica) -> bytes:
            return hashlib.blake2b(f"{replica.replica_id.unique_id}/{key}".encode(), digest_size=8).digest()

        ranked = sorted(candidate_replicas, key=weight, reverse=True)
        return [[ranked[0]], ranked[1:]]  # the prefix's replica, then (when it is full) the others
