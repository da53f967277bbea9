"""The default process group across etcd rounds: formed by etcdrun, released at once, formed
again; or the script's own, adopted and never shut.

Why etcdrun forms the group itself (``elastic.init_process_group``): a release must end a
collective blocked on a frozen peer at once, and only shutting this process's ends of the
group's connections does that for gloo (sockets.py). A release may shut only what etcdrun
created, so etcdrun must have created the group: then it knows its sockets exactly (those of
the round's store it built and of gloo's mesh, sockets.py), and every later round's group is
formed the same way. A script that calls ``dist.init_process_group`` itself keeps working: its
group is *adopted*, and nothing of it is shut. A release then ends what etcdrun waits on (the
DDP all-reduces routed through ``InFlight``, etcdrun's own collectives); a synchronous
collective of the script's own on a frozen peer waits until that peer's process ends (its
sockets close) or gloo's timeout. From the first membership change on, the group is one
etcdrun formed. NCCL has what gloo lacks: its communicator abort is made to be called from
another thread, so a group etcdrun formed on NCCL is released with ``abort()`` (design.md
§4a).

Why a group is formed on a thread of its own: once the addresses are exchanged, gloo's full
mesh waits for each peer that is to dial this rank, and nothing from outside ends that wait
(not a shut store, not a signal) for several times the group's timeout. A round that ends in
that window (its peers released and gone to the next round's store) would hold this rank
there, and the next round with it. So the main thread waits for the form *or* a release;
after a release, the form is told to stop (an exception raised in its thread, which fires the
moment the thread is back in Python, before torch can take the group as its default) and, if
it is still inside gloo a moment later, left behind. What a left-behind form holds (a thread,
gloo's listener and the pairs it made) stays until gloo's own timeout ends the wait;
it happens only when a round ends inside the mesh.

The round is the group's fencing token: the group is formed on the round's own store (a port
its rank 0 reserved for that round alone), and right after forming every rank checks that all
ranks run the same round (one all_gather, which also tells each rank its peers' gloo
listeners), so a worker that missed a round can never take part in a later round's
collectives.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from etcdrun.agent.standby.boot import await_listener
from etcdrun.elastic import sockets
from etcdrun.elastic.inflight import InFlight
from etcdrun.elastic.origin import Failures

FORM_TIMEOUT = timedelta(minutes=30)  # torch's default; an abort ends a wait sooner
STORE_TRY = timedelta(seconds=1)  # one try to reach the round's store; a release ends the tries
NCCL_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # read by ProcessGroupNCCL when it is made
LEAVE_AFTER = 0.5  # seconds a told form has to end before it is left behind inside gloo


class RoundMismatch(RuntimeError):
    """Ranks of different rounds met in one group: this one must not train."""


@dataclass
class Held:
    """What this process still holds of released groups until gloo's own timeout ends it: a
    collective gloo still ran at the release (its group is kept), a form left inside gloo's
    mesh (a thread, a listener). Why counted, not printed: nothing is for the user to do (it
    costs a thread and a few sockets for a while), so it goes to the agent with the next
    ``resumed`` and into its events.jsonl, not onto the console (a plain scale-up printed it).
    """

    collectives: int = 0
    left_in_mesh: int = 0


class Group:
    """One per worker, for its whole life (``elastic.init_process_group`` or ``elastic.run``
    makes it). ``form()`` or ``adopt()``, ``check_round()``, then ``release()`` from any thread,
    then ``drop()`` and ``form()`` again for the next round.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a release, or a form's end
        self._fds: dict[int, int] = {}  # the group's sockets etcdrun may shut: fd to inode
        self._dialled: dict[int, sockets.Sock] = {}  # new in the form: the group's if to a peer
        self._listening = 0  # this rank's gloo listener of the group formed last
        self._released = False
        self._timeout = FORM_TIMEOUT  # the collectives' timeout of every group formed
        self.owned = False  # etcdrun formed the current group (else the script did)
        self.inflight = InFlight()  # DDP's all-reduces, which a release ends (inflight.py)
        self.failures = Failures()  # where an exception arose (origin.py)
        self.held = Held()  # what gloo still holds of released groups, for the agent's events

    def adopt(self) -> None:
        """Take the group the script formed: watched, never shut (module docstring)."""
        import torch.distributed as dist

        with self._lock:
            self._fds, self._dialled, self._listening = {}, {}, 0
            self._released, self.owned = False, False
        self.inflight.restart()
        self.failures.watch(dist.group.WORLD)

    def form(
        self,
        backend: str,
        ended: Callable[[], bool] = lambda: False,
        timeout: timedelta | None = None,
    ) -> None:
        """The default group of the round in ``os.environ``: the store as env:// makes it (so a
        newcomer's own ``init_process_group`` meets the survivors there), then the group.
        Raises when ``release()`` cut it short. The caller then checks the round
        (``check_round``) and re-wraps DDP, in the order a newcomer's script and
        ``elastic.run`` do.

        ``ended()`` says whether the round being formed is over already: a release that came
        before this call (the notice can follow the round's hand-over at once) is not lost to
        the reset of ``_released`` here (chaos seed 92: a survivor tried forever to reach the
        store of a round that had ended before it began to form it). ``timeout``: the group's
        collectives' (the first form's is kept for every later round's group).
        """
        import torch.distributed as dist

        if timeout is not None:
            self._timeout = timeout
        before = sockets.census()
        store_port = int(os.environ["MASTER_PORT"])
        with self._lock:
            self._released, self.owned = False, True
            self._fds, self._dialled, self._listening = {}, {}, 0
        self.inflight.restart()
        store, rank, world = self._store(ended)
        with self._lock:  # the store's own sockets, so that a release ends a wait on them too
            self._fds = sockets.the_groups(
                sockets.new_since(before, sockets.census()), store_port, set()
            )
        if self._released or ended():  # a release from now on shuts the store's socket
            raise ConnectionAbortedError("the round ended while its group was formed")
        _reset_group_names()
        self._init(backend, dist.PrefixStore("default_pg", store), rank, world)
        new = sockets.new_since(before, sockets.census())
        with self._lock:
            self._listening = sockets.listener_port(new)
            self._fds = sockets.the_groups(new, store_port, set())
            self._dialled = {fd: s for fd, s in new.items() if fd not in self._fds}
            if self._released:  # came while gloo connected: its new sockets are cut now
                sockets.shut(self._fds)
        self.failures.watch(dist.group.WORLD)

    def _init(self, backend: str, store: Any, rank: int, world: int) -> None:
        """``init_process_group`` on a thread that a release can leave behind (see the module
        docstring). Raises when it was left behind, or with the form's own error.
        """
        import torch
        import torch.distributed as dist

        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        ended: list[BaseException | None] = []
        if backend == "nccl" and os.environ.get(NCCL_HANDLING) == "1":
            # torchrun's default, which the agent sets: NCCL's watchdog tears the process down
            # on a failed collective, and a release's abort fails them. A kept worker needs its
            # process: the communicators are cleaned up, the error raised, nothing torn down.
            os.environ[NCCL_HANDLING] = "2"

        def init() -> None:
            error: BaseException | None = None
            try:
                try:
                    if device is not None:  # the current device is the thread's own
                        torch.cuda.set_device(device)
                    dist.init_process_group(
                        backend, store=store, rank=rank, world_size=world, timeout=self._timeout
                    )
                except BaseException as e:  # _Told among them: the form's end, whatever it is
                    error = e
                with self._lock:
                    ended.append(error)
                    self._changed.notify_all()
            except _Told:  # told just after the form ended: the caller's drop() ends the group
                pass

        former = threading.Thread(target=init, name="etcdrun-form", daemon=True)
        former.start()
        with self._lock:
            self._changed.wait_for(lambda: bool(ended) or self._released)
            if not ended:  # told under the lock, so never after its end was written
                _raise_in(former, _Told)
        former.join(LEAVE_AFTER)
        with self._lock:
            if not ended:
                self.held.left_in_mesh += 1
                raise ConnectionAbortedError(
                    "the round ended while its group was formed; its form was left inside gloo"
                )
            error = ended[0]
        if isinstance(error, _Told):
            raise ConnectionAbortedError("the round ended while its group was formed") from None
        if error is not None:
            raise error

    def _store(self, ended: Callable[[], bool]) -> tuple[Any, int, int]:
        """The round's store where env:// has it (rank 0 serves it at MASTER_PORT), built so
        that a release ends the wait. Why not ``dist.rendezvous("env://")``: its TCPStore
        cannot be released while it is built — rank 0 waits there for every rank to connect,
        the others retry their connect — for FORM_TIMEOUT (chaos seed 92: a round that ended
        while a fresh rank was still starting held the survivors 30 minutes). So rank 0 does
        not wait for the others (gloo's own exchange then waits on the store's socket, which a
        release shuts), and the others try STORE_TRY at a time until the round ends (a release
        also ends the wait for rank 0 to listen: a superseded round's host may never serve),
        each try dialling once rank 0 listens (a refused torch client waits ~0.5 s before it
        dials again, and rank 0 may still be releasing its old group when the others are handed
        the round).
        The others still count themselves in the store (``wait_for_workers``: a client only
        adds one to the count, never waits), as a fresh rank 0's env:// store waits for every
        rank's count (chaos seed 1010 hung there when they did not).
        """
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        over = functools.partial(self._over, ended)
        while True:
            if rank != 0:  # dial once it listens: a refused client retries only ~0.5 s later
                await_listener(addr, port, STORE_TRY.total_seconds(), stop=over)
                if over():
                    raise ConnectionAbortedError("the round ended while its store was dialled")
            try:
                store = dist.TCPStore(
                    addr,
                    port,
                    world,
                    rank == 0,
                    timeout=FORM_TIMEOUT if rank == 0 else STORE_TRY,
                    wait_for_workers=rank != 0,  # a client only counts itself in: a fresh
                    multi_tenant=True,  # rank 0's env:// store waits for that count
                )
            except RuntimeError:  # torch's DistNetworkError and DistStoreError among them
                with self._lock:
                    if rank == 0 or self._released or ended():
                        raise
                continue
            store.set_timeout(FORM_TIMEOUT)
            return store, rank, world

    def _over(self, ended: Callable[[], bool]) -> bool:
        """The round being formed ended: released, or said over before the form began."""
        with self._lock:
            released = self._released
        return released or ended()

    def check_round(self) -> None:
        """Every rank runs the round this worker runs in (the fencing token), or raise
        ``RoundMismatch``. The same all_gather tells each rank its peers' gloo listeners: the
        pairs it dialled to them are the group's from now on (sockets.py).
        """
        import torch
        import torch.distributed as dist

        round_ = int(os.environ.get("ETCDRUN_ROUND", "0"))
        mine = torch.tensor([round_, self._listening], dtype=torch.int64, device=device())
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        self.inflight.wait(dist.all_gather(every, mine, async_op=True))
        every = [t.tolist() for t in every]
        seen = sorted({r for r, _ in every})
        if seen != [round_]:
            raise RoundMismatch(f"ranks of rounds {seen} met in one process group")
        peers = {port for _, port in every} - {0}
        with self._lock:
            if not self.owned:
                return
            store_port = int(os.environ["MASTER_PORT"])
            dialled = sockets.the_groups(self._dialled, store_port, peers)
            self._fds.update(dialled)
            self._dialled = {}
            if self._released:
                sockets.shut(dialled)

    def release(self) -> None:
        """Make every collective etcdrun waits on fail now (any thread). A group etcdrun formed:
        gloo's connections are shut, NCCL's communicators aborted. An adopted group: only the
        collectives waited on through ``inflight`` (module docstring).
        """
        with self._lock:
            self._released = True
            self._changed.notify_all()
            fds, owned = dict(self._fds), self.owned
        if owned and _backend() == "nccl":
            _abort_world()
        else:
            sockets.shut(fds)
        self.inflight.end()

    def drop(self) -> None:
        """Forget the released group (the main thread, before forming the next)."""
        import torch.distributed as dist

        self.failures.close()
        if dist.is_initialized():
            running = self._settled(LEAVE_AFTER)
            if running:  # destroying the group would join the thread gloo holds
                _keep(dist.group.WORLD)
                self.held.collectives += len(running)
            _abort_default_group()
        with self._lock:
            self._fds, self._dialled = {}, {}

    def _settled(self, wait: float) -> list[Any]:
        """gloo's collectives of the released group still running after up to ``wait`` s.
        Why wait at all: a collective every rank had entered goes on inside gloo after the
        release failed etcdrun's future for it (an adopted group's sockets are not shut), and
        it ends a moment later; only one that gloo holds past that keeps the group.
        """
        deadline = time.monotonic() + wait
        while (running := self.inflight.running()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return running


class _Told(BaseException):
    """Raised in a form's thread to stop it: a BaseException, so torch's own handlers of
    errors cannot take it for one of theirs and go on.
    """


def _keep(group: Any) -> None:
    """Never destroy ``group``, not even when the interpreter exits: its destructor joins its
    collectives' threads, and one that gloo still runs would hold the process there until
    gloo's timeout. The process's end frees what the group holds.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _raise_in(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise ``exc`` in ``thread`` the next time it runs Python (CPython's asynchronous
    exception: a thread inside C++ is reached when it comes back).
    """
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(exc)
        )


def _backend() -> Any:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else None


def _reset_group_names() -> None:
    """Name the group to be formed as a fresh process names its first: torch names each default
    group after a counter (``_world.group_count``, the prefix of the group's keys in the store)
    that only a destroyed or aborted WORLD resets. A form cut short inside
    ``init_process_group`` took a name and made no WORLD, so the next form would be named "1"
    where a fresh rank's group is "0", and their keys would never meet (chaos seeds 1081 and 92
    hung there, every rank waiting in gloo's connect). With no default group alive, the counter
    goes back as torch's own reset sets it.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def device() -> Any:
    """Where the default group's tensors live: NCCL's on the worker's current GPU (torch 2.14
    registers an NCCL group for CUDA tensors only), gloo's on the CPU.
    """
    import torch

    if _backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _abort_world() -> None:
    """Abort the default group's communicators (NCCL: ncclCommAbort), from any thread: made for
    it. The group itself is destroyed by ``drop()``, on the main thread, which may still be
    using it now.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.group.WORLD.abort()


def _abort_default_group() -> None:
    """Abort (NCCL: ncclCommAbort) and forget the default group: torch's own way to end a group
    whose peers may never answer, where ``destroy_process_group`` alone would wait for them.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.group.WORLD.abort()
    except RuntimeError:  # a backend without abort: destroying it is all there is
        pass
    dist.destroy_process_group()


__all__ = ["FORM_TIMEOUT", "Group", "RoundMismatch"]
