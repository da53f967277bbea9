"""Real etcd processes on this machine, for the tests, the benchmarks and the README demo.

Why apart from ``etcdrun.rendezvous.client``: the runtime client talks to an etcd somebody else
runs; starting, killing and probing etcd processes is what tests, the bench and the demo need.
It ships in the wheel only so that ``python examples/demo.py`` works from a plain install.
``member.py`` is one etcd process (the unit fault tests kill, pause and restart); ``cluster.py``
builds clusters of them.
"""

from etcdrun.rendezvous.localetcd.cluster import LocalEtcd
from etcdrun.rendezvous.localetcd.member import EtcdMember, TlsConfig, find_etcd, grpc_channel

__all__ = ["EtcdMember", "LocalEtcd", "TlsConfig", "find_etcd", "grpc_channel"]
