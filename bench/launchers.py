"""The launcher configurations bench/compare.py runs side by side, and their command lines.

Why one interpreter for both: etcdrun and torch are installed in the bench's own venv, and both
launchers start their workers with ``sys.executable``, so the same worker script runs on the same
Python with the same torch under either launcher. etcdrun's agent itself never imports torch.

Why ``--max-restarts 10`` for every launcher: when a node dies, the survivors' workers fail in
their next collective, and each launcher spends a restart on that; with torchrun's default of 0
the job would simply end, and neither launcher would show a recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MAX_RESTARTS = 10
WORKER = Path(__file__).with_name("compare_worker.py")

ETCDRUN, TORCHRUN = "etcdrun", "torchrun"


@dataclass(frozen=True)
class Launcher:
    key: str  # stable id used in results
    label: str  # what the tables show
    kind: str  # ETCDRUN or TORCHRUN
    backend: str  # etcd (etcdrun), c10d, etcd-v2 or etcd-v3 (torchrun; etcd-v3 is our plugin)
    conf: str = ""  # --rdzv-conf
    tuned: bool = False
    env: dict[str, str] = field(default_factory=dict)
    last_call: float = 30.0  # seconds its first round may wait for more nodes (both default 30)

    @property
    def needs_etcd(self) -> bool:
        return self.backend in ("etcd", "etcd-v2", "etcd-v3")

    def with_env(self, key: str, label: str, **env: str) -> Launcher:
        return Launcher(
            key,
            label,
            self.kind,
            self.backend,
            self.conf,
            self.tuned,
            {**self.env, **env},
            self.last_call,
        )

    def command(
        self,
        bindir: Path,
        nnodes: str,
        endpoint: str,
        run_id: str,
        mode: str,
        worker: Sequence[str] = (),
    ) -> list[str]:
        """The agent's command line; ``worker`` (script and its argv) replaces compare's
        ``compare_worker.py MODE``.
        """
        cmd = [
            str(bindir / self.kind),
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            self.backend,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--max-restarts",
            str(MAX_RESTARTS),
            "--monitor-interval",
            "0.1",
        ]
        if self.conf:
            cmd += ["--rdzv-conf", self.conf]
        return [*cmd, *(worker or (str(WORKER), mode))]


_ETCDRUN_TUNED = "lease_ttl=2,last_call_timeout=1"
_TORCH_TUNED = "last_call_timeout=1,keep_alive_interval=1"
# torchrun's agent store is shared with its rendezvous store by default and outlives a restart:
# the new workers' gloo init reads the dead attempt's addresses from it ("Connection refused"),
# so with defaults the survivors never run again, and a newcomer deadlocks. The issue asks for
# the sharing off where the default deadlocks; we turn it off in every tuned torchrun run, so
# "tuned" is the best torchrun can do here.
NO_SHARE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
_NO_SHARE_LABEL = " + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"

LAUNCHERS = {
    "etcdrun": Launcher("etcdrun", "etcdrun", ETCDRUN, "etcd"),
    "etcdrun-tuned": Launcher(
        "etcdrun-tuned",
        f"etcdrun ({_ETCDRUN_TUNED})",
        ETCDRUN,
        "etcd",
        _ETCDRUN_TUNED,
        tuned=True,
        last_call=1.0,
    ),
    "c10d": Launcher("c10d", "torchrun c10d", TORCHRUN, "c10d"),
    "c10d-tuned": Launcher(
        "c10d-tuned",
        f"torchrun c10d ({_TORCH_TUNED}{_NO_SHARE_LABEL})",
        TORCHRUN,
        "c10d",
        _TORCH_TUNED,
        tuned=True,
        env=NO_SHARE,
        last_call=1.0,
    ),
    "etcd-v2": Launcher("etcd-v2", "torchrun etcd-v2", TORCHRUN, "etcd-v2"),
    "etcd-v2-tuned": Launcher(
        "etcd-v2-tuned",
        f"torchrun etcd-v2 ({_TORCH_TUNED}{_NO_SHARE_LABEL})",
        TORCHRUN,
        "etcd-v2",
        _TORCH_TUNED,
        tuned=True,
        env=NO_SHARE,
        last_call=1.0,
    ),
    # Plain torchrun on etcdrun's rendezvous (the torchrun plugin): the same torchrun flags as
    # the other torchrun columns, one word changed. No store to share: nothing to turn off.
    "etcd-v3": Launcher("etcd-v3", "torchrun + etcd-v3", TORCHRUN, "etcd-v3"),
    "etcd-v3-tuned": Launcher(
        "etcd-v3-tuned",
        f"torchrun + etcd-v3 ({_TORCH_TUNED})",
        TORCHRUN,
        "etcd-v3",
        _TORCH_TUNED,
        tuned=True,
        last_call=1.0,
    ),
}
