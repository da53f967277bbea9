"""Two ways to re-form the gloo group at a membership change, measured side by side.

    python -m bench.reform [--quick] [--seeds 16] [--rounds 10] [--reps 5] [--only 1,4]
        [--out PATH] [--json RAW] [--from-json RAW] [--keep]

Why: etcdrun.elastic re-forms a FRESH group every round (``Group``: a new TCPStore at
MASTER_PORT and a new ``init_process_group``), after releasing the old one by shutting its
sockets. torch 2.14 offers ``init_process_group(enable_reconfigure=True)`` once and
``dist._reconfigure`` per round, which takes milliseconds. Which one holds where? Five cases,
each run for both paths on 3 local processes (a 4th as a newcomer), without agents or etcd:
release stress (bench/release_stress.py's, with InFlight's hook and with DDP's own
all-reduce), the first store's host SIGKILLed, a newcomer, a synchronous all_reduce blocked on
a SIGSTOPped peer, and a round superseded while it forms. The results page is
bench/results/reform.md.

The package, by concept. The driver (never imports torch while cases run): ``__main__`` (the
command line), ``harness`` (forkserver, ports, launching ranks, reading their logs, a hung
rank's stacks), one module per case (``stress``, ``host_killed``, ``newcomer``, ``blocked``,
``supersede``), and the page: ``report`` (the tables) and ``verdict`` (what they say). The
ranks: ``worker`` (each case's rank side and ``main``), ``paths`` (fresh and reconf, the two
ways to re-form) and ``rank`` (a rank's log, model, and the driver's notices).
"""
