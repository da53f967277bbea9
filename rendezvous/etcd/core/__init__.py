"""The bottom layer of the etcd backend: what a run is in etcd and the rules over it, with no
I/O of its own beyond what a caller hands in. The run's key layout (keys.py), the values
(codec.py), the pure decision (protocol.py, carry.py) and the fenced transactions built without
I/O (transitions.py), the shard layout (shards.py, shard_reads.py), what a node knows of the
round key (round_view.py, round_watch.py), the settings (config.py; rdzv_conf.py reads
torchrun's keys onto them), the run context (context.py), the straggler rule (stragglers.py),
the drain request (drain_request.py) and the Session, the lease every recipe above borrows
(session.py). Nothing here imports node/, leader/, ports/ or the handler
(tests/project/test_imports.py).
"""
