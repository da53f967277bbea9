"""A callable entrypoint doing one gloo all_reduce, launched by ``elastic_launch`` with 3 workers
(etcdrun's, or torch's for comparison): ``python allreduce_callable.py etcdrun|torch``.

Exit 0 when every worker returned its rank's sum; a failed launch raises (exit 1) with the
launcher's report on stderr, which names a worker killed by SIGABRT.
"""

import os
import socket
import sys

WORKERS = 3


def allreduce_once() -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item())


def main(launcher: str) -> None:
    if launcher == "torch":
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    else:
        from etcdrun.agent.launcher import LaunchConfig, elastic_launch
    with socket.socket() as s:  # the static backend on a free port, for both launchers
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=WORKERS,
        run_id="clean-exit",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        start_method=os.environ.get("START_METHOD", "spawn"),
    )
    results = elastic_launch(config, allreduce_once)()
    expected = {r: (r, WORKERS * (WORKERS + 1) // 2) for r in range(WORKERS)}
    assert results == expected, results
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "etcdrun")
