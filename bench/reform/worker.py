"""What runs in each rank: the rank's side of every case, and ``main(spec)``, its whole life.

Started by bench/reform/harness.py from a forkserver that imported this module (and torch with
it) once: ``main(spec)``, or by hand ``python -m bench.reform.worker SPEC_JSON``. The spec
names the case and the path (bench/reform/paths.py: fresh, reconf, reconf-plain,
reconf-alone), the rank, the round ports, and the launch's directory for the log and the
driver's notices (bench/reform/rank.py). The driver side of each case, which starts these ranks,
SIGKILLs or SIGSTOPs one, and reads their logs, is the case's own module in bench/reform/. A
rank always ends with ``os._exit``: a gloo thread still held would hold a normal exit.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bench.reform import rank as rank_
from bench.reform.paths import (
    HOST,
    RECONF_S,
    Fresh,
    Reconf,
    SwapStore,
    check,
    make_path,
    round_store,
)
from bench.reform.rank import await_notice, emit, error, meet, step, train, train_round, wrap
from etcdrun.agent.standby.boot import await_listener
from etcdrun.elastic.group import Group
from etcdrun.elastic.inflight import InFlight


def case_stress(s: dict[str, Any], path: Fresh | Reconf) -> None:
    """Case 1, as bench/release_stress_worker.py: train, a release at a drawn moment, re-form."""
    rank, world, seed = s["rank"], s["world"], s["seed"]
    for k in range(s["rounds"]):
        path.form(k, rank, world, s["ports"][k])
        emit("formed", k=k, parts=path.parts)
        model, opt = wrap(path, s["hook"])
        at = random.Random(seed * 1000 + k).uniform(0.3, 0.7)  # the same on every rank
        at += random.Random(seed * 1000 + k * 10 + rank).uniform(0, 0.06)
        released = threading.Event()

        def release(done: threading.Event = released, k: int = k) -> None:
            t = time.monotonic()
            path.release()
            emit("rel", k=k, t=t)
            done.set()

        began = time.monotonic()
        threading.Timer(at, release).start()
        steps, how = train(model, opt, released.is_set)
        released.wait()
        emit("left", k=k, steps=steps, how=how, left_s=time.monotonic() - began - at)
        meet(s["dir"], f"k{k}", rank, range(world))


def case_kill0(s: dict[str, Any], path: Fresh | Reconf) -> None:
    """Case 2: the driver SIGKILLs rank 0 (the first store's host) while the three train; the
    survivors release and re-form as ranks 0 and 1 of round 1 (old rank 1 serves its store).
    """
    rank = s["rank"]
    path.form(0, rank, 3, s["ports"][0])
    emit("formed", k=0)
    how, t = train_round(path, s["dir"], "dead")
    emit("rel", k=0, t=t, how=how)
    try:
        path.form(1, rank - 1, 2, s["ports"][1])
        emit("formed", k=1, parts=path.parts)
        model, opt = wrap(path, True)
        for _ in range(3):
            step(model, opt)
        emit("ok", world=dist.get_world_size(), rank_now=dist.get_rank())
    except Exception as e:
        emit("error", after_s=time.monotonic() - t, stage=getattr(path, "stage", ""), **error(e))


def case_join(s: dict[str, Any], path: Fresh | Reconf) -> None:
    """Case 3: round 0 has three ranks; rank 2 leaves (round 1: two survivors); a newcomer
    joins them in round 2. The newcomer: ``newcomer()``.
    """
    rank, d = s["rank"], s["dir"]
    path.form(0, rank, 3, s["ports"][0])
    emit("formed", k=0)
    t = train_round(path, d, "go1")[1]
    emit("rel", k=0, t=t)
    if rank == 2:
        emit("ok", left=True)
        return
    path.form(1, rank, 2, s["ports"][1])
    emit("formed", k=1, parts=path.parts)
    t = train_round(path, d, "go2")[1]
    emit("rel", k=1, t=t)
    path.form(2, rank, 3, s["ports"][2])
    emit("formed", k=2, parts=path.parts)
    model, opt = wrap(path, True)
    for _ in range(3):
        step(model, opt)
    emit("ok", world=dist.get_world_size())


def newcomer(s: dict[str, Any]) -> None:
    """Case 3's newcomer, rank 2 of round 2, started ahead and waiting for the notice; it dials
    once the round's store listens (``early``: at once, torch's client then retries). fresh: a
    script's own ``dist.init_process_group`` (env://) on the round's store, adopted by a Group
    whose check_round is the survivors' first collective; reconf: ``init_process_group(
    enable_reconfigure=True)`` on a SwapStore, then the round's ``_reconfigure``.
    """
    port = s["ports"][2]
    await_notice(s["dir"], "go2")
    t = time.monotonic()
    emit("rel", k=1, t=t)  # the moment it is told to join
    if not s.get("early"):  # as a script that starts after the store listens (imports: seconds)
        await_listener(HOST, port, 10.0)
    if s["path"] == "fresh":
        os.environ.update(RANK="2", WORLD_SIZE="3", MASTER_PORT=str(port), ETCDRUN_ROUND="2")
        dist.init_process_group("gloo")
        t1 = time.monotonic()
        group = Group()
        group.adopt()
        group.check_round()
        inflight = group.inflight
        parts = {"init": t1 - t, "check": time.monotonic() - t1}
    else:
        store = round_store(2, 3, port, lambda: False)
        t1 = time.monotonic()
        swap = SwapStore()
        swap.inner = store
        dist.init_process_group("gloo", store=swap, rank=2, world_size=3, enable_reconfigure=True)
        t2 = time.monotonic()
        store.set("h/2/2", dist._get_reconfigure_handle())
        handles = [store.get(f"h/2/{r}").decode() for r in range(3)]
        t3 = time.monotonic()
        dist._reconfigure(2, handles, timeout=timedelta(seconds=RECONF_S)).wait()
        t4 = time.monotonic()
        inflight = InFlight()
        check(2, inflight)
        parts = {"store": t1 - t, "init": t2 - t1, "handles": t3 - t2, "reconfigure": t4 - t3}
        parts["check"] = time.monotonic() - t4
    emit("formed", k=2, parts=parts)
    model = torch.nn.parallel.DistributedDataParallel(rank_.NET)
    inflight.hook(model)
    opt = torch.optim.SGD(rank_.NET.parameters(), lr=1e-3)
    for _ in range(3):
        step(model, opt)
    emit("ok", world=dist.get_world_size())


def case_stop(s: dict[str, Any], path: Fresh | Reconf) -> None:
    """Case 4: rank 2 is SIGSTOPped by the driver; ranks 0 and 1 block in a synchronous
    ``dist.all_reduce`` of the script's own; 1 s later each releases (``reconf-alone``:
    ``_reconfigure`` to the two of them, no shut). Released, and then re-formed, in how long?
    """
    rank, d, alone = s["rank"], s["dir"], s["path"] == "reconf-alone"
    path.form(0, rank, 3, s["ports"][0])
    x = torch.ones(1)
    dist.all_reduce(x)
    handles: list[str] = []
    if alone and rank < 2:  # uuid 1's handles, exchanged before the block (REPORT Q5 a)
        assert isinstance(path, Reconf)
        path._store.set(f"h/1/{rank}", dist._get_reconfigure_handle())
        handles = [path._store.get(f"h/1/{r}").decode() for r in range(2)]
    emit("formed", k=0, sum=x.item())
    if rank == 2:
        time.sleep(120)  # the driver stops this process, then kills it
        return
    await_notice(d, "stopped")
    acted, at = release_later(path, handles if alone else None, s["watch_s"])
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        emit("returned", blocked_s=time.monotonic() - t0)
        return
    except Exception as e:
        t = time.monotonic()
        acted.wait()
        emit("released", t=t, blocked_s=t - t0, after_s=t - at[0], **error(e))
    if alone:
        return
    path.form(1, rank, 2, s["ports"][1])
    emit("formed", k=1, since_act_s=time.monotonic() - at[0], parts=path.parts)
    y = torch.ones(1)
    dist.all_reduce(y)
    emit("ok", sum=y.item())


def release_later(
    path: Fresh | Reconf, handles: list[str] | None, watch_s: float
) -> tuple[threading.Event, list[float]]:
    """Case 4's release, 1 s from now on a thread of its own (the main thread is blocked):
    ``path.release()``, or with ``handles`` (reconf-alone) ``_reconfigure`` to the two ranks.
    A watchdog then gives the blocked all_reduce ``watch_s`` to return, and ends the process
    with a ``not_released`` event if it does not. (set once the release returned, its time).
    """
    acted = threading.Event()
    at: list[float] = []

    def act() -> None:
        at.append(time.monotonic())
        try:
            if handles is not None:
                dist._reconfigure(1, handles, timeout=timedelta(seconds=5)).wait()
                emit("act", t=at[0], returned_s=time.monotonic() - at[0])
            else:
                path.release()
                emit("act", t=at[0], returned_s=time.monotonic() - at[0])
        except Exception as e:
            emit("act", t=at[0], returned_s=time.monotonic() - at[0], **error(e))
        acted.set()

    def watchdog() -> None:
        acted.wait()
        time.sleep(watch_s)
        emit("not_released", after_s=time.monotonic() - at[0])
        os._exit(3)

    threading.Timer(1.0, act).start()
    threading.Thread(target=watchdog, daemon=True).start()
    return acted, at


def case_supersede(s: dict[str, Any], path: Fresh | Reconf) -> None:
    """Case 5: round k (odd) is superseded while it forms: the rank ``i % 3`` is told before it
    reaches the form and goes straight to round k+1; the others are released D after they
    began forming k (D drawn, 0-200 ms). Does every rank reach round k+1, and when?
    """
    rank, d, seed = s["rank"], s["dir"], s["seed"]
    path.form(0, rank, 3, s["ports"][0])
    emit("formed", k=0)
    for i in range(s["reps"]):
        k, skip = 1 + 2 * i, i % 3
        delay = random.Random(seed * 100 + i).uniform(0.0, 0.2)
        meet(d, f"s{i}", rank, range(3))
        t = time.monotonic()
        path.release()  # the round k-1 is over for everyone
        emit("rel", k=k - 1, t=t)
        if rank == skip:
            emit("skip", k=k)
        else:
            over = threading.Event()

            def end(over: threading.Event = over, k: int = k) -> None:
                t = time.monotonic()
                over.set()
                path.release()
                emit("rel", k=k, t=t)

            threading.Timer(delay, end).start()
            try:
                path.form(k, rank, 3, s["ports"][k], over.is_set)
                emit("formed", k=k)  # cannot happen: a rank never came
            except Exception as e:
                emit("form_ended", k=k, delay_s=delay, **error(e))
            over.wait()
        path.form(k + 1, rank, 3, s["ports"][k + 1])
        emit("formed", k=k + 1, parts=path.parts)


CASES = {
    "stress": case_stress,
    "kill0": case_kill0,
    "join": case_join,
    "stop": case_stop,
    "supersede": case_supersede,
}


def main(spec: dict[str, Any]) -> None:
    """The process's whole life: its log, then its case; it always ends with os._exit (a gloo
    thread still held would hold a normal exit).
    """
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the launcher
    rank_.begin(spec)
    emit("start", pid=os.getpid())
    try:
        if spec["who"] == "new":
            newcomer(spec)
        else:
            CASES[spec["case"]](spec, make_path(spec["path"]))
    except BaseException as e:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        emit("crash", **error(e))
        sys.stderr.flush()
        os._exit(1)
    emit("done")
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
