"""torchrun's ``etcd-v3`` rendezvous backend: plain torchrun on etcdrun's rendezvous.

Why: torchrun's own etcd backends (``etcd``, ``etcd-v2``) speak etcd's v2 API, which etcd 3.6
dropped, and its ``c10d`` backend keeps the rendezvous in a TCPStore on one node, which dies
with it. ``torchrun --rdzv-backend etcd-v3 --rdzv-endpoint host:2379 --rdzv-id J --nnodes 2:4
train.py`` runs on etcdrun's rendezvous (EtcdRendezvousHandler, wrapped here in torch's
RendezvousHandler) and an etcd-backed store (torch/store.py). torch finds it through the entry
point ``torchrun.handlers: etcd-v3`` (torch/entry.py). This module and torch/store.py are the only
ones that import torch; etcdrun's own agent never imports them.

torch's calls, mapped:
- ``next_rendezvous()`` joins our next round and returns torch's ``RendezvousInfo``: the node
  rank and node count of the round, an EtcdStore on ``/<prefix>/<run_id>/store/<round>/``
  leased by this node's session, and ``bootstrap_store_info`` = the round's master address and
  the port the rank-0 node reserved (the workers' ``MASTER_ADDR``/``MASTER_PORT``; their rank 0
  hosts the TCPStore of ``init_process_group``, as under etcdrun). When torchrun calls it while
  its round still runs unchanged, a worker failed: that opens the next round first (our
  ``request_restart``, without a failure record: torchrun keeps its own per-node budget).
- ``num_nodes_waiting()``: torchrun's agent polls it every monitor interval and restarts its
  workers when > 0. It is 1 once the round this node runs in is superseded (a node died, left
  or arrived while below max, or our lease is lost), else 0 — read from the round-key watch,
  no etcd request. Hot spares beyond max open no round, so they never make torchrun restart.
- ``shutdown()`` closes the run, then leaves (lease revoked), as torch's own backends close it:
  torchrun calls it when its agent ends, for good or with a failure (not on a signal). A node
  that never ran in a round (a hot spare whose wait timed out) only leaves.
- ``is_closed``, ``set_closed``, ``get_run_id``: ours. ``use_agent_store``: False (no TCPStore
  hosted by the agent). Our errors become torch's of the same name.

torchrun's ``--rdzv-conf`` keys: etcd/core/rdzv_conf.py. What torchrun's agent asks of the store
per node and round, and how soon the plugin recovers from a kill -9 beside torchrun's own
backends: bench/results/figures.md, and the ``torchrun + etcd-v3`` column of bench/results.md's
tables.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous import api as tapi

from etcdrun.rendezvous import errors as ours
from etcdrun.rendezvous.api import RendezvousInfo as OurInfo
from etcdrun.rendezvous.api import RendezvousParameters
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.etcd.core.keys import one_node_run_id
from etcdrun.rendezvous.etcd.core.rdzv_conf import endpoints, read_torch_conf
from etcdrun.rendezvous.etcd.handler import EtcdRendezvousHandler
from etcdrun.rendezvous.torch.entry import BACKEND
from etcdrun.rendezvous.torch.store import EtcdStore

log = logging.getLogger(__name__)

RESTART_REASON = "torchrun restarts its worker group (a worker failed)"
_ERRORS: tuple[tuple[type[ours.RendezvousError], type[tapi.RendezvousError]], ...] = (
    (ours.RendezvousClosedError, tapi.RendezvousClosedError),
    (ours.RendezvousTimeoutError, tapi.RendezvousTimeoutError),
    (ours.RendezvousConnectionError, tapi.RendezvousConnectionError),
    (ours.RendezvousStateError, tapi.RendezvousStateError),
)


def torch_error(e: ours.RendezvousError) -> tapi.RendezvousError:
    """Our error as torch's class of the same name (torchrun's agent catches torch's)."""
    for mine, theirs in _ERRORS:
        if isinstance(e, mine):
            return theirs(str(e))
    return tapi.RendezvousError(str(e))


class EtcdV3RendezvousHandler(tapi.RendezvousHandler):
    """torch's handler interface over one EtcdRendezvousHandler (see the module docstring)."""

    def __init__(self, inner: EtcdRendezvousHandler) -> None:
        self.inner = inner
        self._took_part = False  # this node has run in a round

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> tapi.RendezvousInfo:
        try:
            if self.inner.view.running() is not None and not self.inner.membership_changed.is_set():
                self.inner.request_restart(RESTART_REASON)
            info = self.inner.next_rendezvous()
        except ours.RendezvousError as e:
            raise torch_error(e) from e
        self._took_part = True
        return tapi.RendezvousInfo(
            self._store(info),
            info.node_rank,
            info.node_count,
            tapi.RendezvousStoreInfo(info.master_addr, info.master_port),
        )

    def num_nodes_waiting(self) -> int:
        """1 while the round this node runs in is superseded, else 0; no etcd request."""
        return 1 if self.inner.membership_changed.is_set() else 0

    def is_closed(self) -> bool:
        try:
            return self.inner.is_closed()
        except ours.RendezvousError as e:
            raise torch_error(e) from e

    def set_closed(self) -> None:
        try:
            self.inner.set_closed()
        except ours.RendezvousError as e:
            raise torch_error(e) from e

    def shutdown(self) -> bool:
        """Close the run (torch's backends do), then leave; True when both went cleanly.

        A node that never ran in a round only leaves: a hot spare whose wait timed out, or a
        node that failed before its first round, must not end the job the others run.
        """
        closed = True
        try:
            if self._took_part:
                self.inner.set_closed()
        except ours.RendezvousError as e:
            log.warning("etcd-v3: could not close the run at shutdown: %s", e)
            closed = False
        return self.inner.shutdown() and closed

    # ---- the round's store -----------------------------------------------------------------------
    def store_prefix(self, round_number: int) -> str:
        return f"{self.inner.keys.root}store/{round_number:010d}/"

    def _store(self, info: OurInfo) -> EtcdStore:
        sess = self.inner.session
        if sess is None:  # the session went between the freeze and now: torchrun starts over
            raise tapi.RendezvousConnectionError(
                f"etcd-v3: the session of node {info.node_id} was lost (run {info.run_id})"
            )
        prefix = self.store_prefix(info.round)
        if info.node_rank == 0:
            self._drop_older_stores(prefix)
        return EtcdStore(self.inner.client, prefix, lease=sess.lease_id)

    def _drop_older_stores(self, prefix: str) -> None:
        """Rank 0 removes the store keys of earlier rounds (every key is leased as well, so this
        only frees etcd sooner than the last node's exit would).
        """
        try:
            self.inner.client.delete(self.store_prefix(0), range_end=prefix)
        except EtcdError as e:
            log.warning("etcd-v3: could not remove older rounds' store keys: %s", e)


def create_handler(params: tapi.RendezvousParameters) -> EtcdV3RendezvousHandler:
    """torch's RendezvousParameters (``config``: torchrun's ``--rdzv-conf``) -> the handler."""
    conf = read_torch_conf(params.config)
    for line in conf.notices:
        log.warning("%s", line)
    run_id = one_node_run_id(params.run_id, params.max_nodes)
    if run_id != params.run_id:  # torchrun's default id: a one-node job gets its own
        log.warning("etcd-v3: no --rdzv-id given: this one-node job runs as %s", run_id)
    mine = RendezvousParameters(
        BACKEND,
        endpoints(params.endpoint, conf.https),
        run_id,
        params.min_nodes,
        params.max_nodes,
        local_addr=params.local_addr,
        config=conf.config,
    )
    return EtcdV3RendezvousHandler(EtcdRendezvousHandler(mine))


def register() -> None:
    """Register ``etcd-v3`` in torch's registry by hand, where the entry point is not installed
    (a source checkout on ``sys.path``). The same creator as the entry point's: no conflict.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from etcdrun.rendezvous.torch import entry as torch_entry

    rendezvous_handler_registry.register(BACKEND, torch_entry.create_handler)


__all__ = ["BACKEND", "EtcdV3RendezvousHandler", "create_handler", "register", "torch_error"]
