"""What a node needs from a round against what the round key makes etcd send: the input to
issue 31's fan-out choice (a compact round, a per-node assignment, or etcd's grpc-proxy).

Why apart and without etcd: the sizes follow from the encoding alone (codec.round_to, the real
one), so they can be had for any N in a second, where the scale bench needs minutes per N. Every
participant watches the round key, so a frozen round of value size V costs etcd N x V bytes of
watch events at the least; a node needs only its own entry and the round's totals. The last
columns are the same round sharded (design.md §2, "Sharded rounds"): a header watched by N
nodes, and one shard key watched by the nodes that hash to it.

Usage: ``python -m bench.scale_fanout [--n 1000,4096,8192]``.
"""

from __future__ import annotations

import argparse
import sys


def members(n: int, hosts: str) -> tuple:
    """N participants as the scale bench makes them (``one`` host: ids differ by suffix) or as
    a cluster would (``distinct`` hosts and addresses); 8 workers each.
    """
    from etcdrun.rendezvous.etcd.core.protocol import Member

    out = []
    for i in range(n):
        host = "vm-0ff90" if hosts == "one" else f"gpu-{i:05d}.rack{i // 32:03d}.cluster.local"
        addr = "10.0.0.1" if hosts == "one" else f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"
        out.append(Member(f"{host}.{i:08x}"[:40], i, 8, addr, 8 * i, host, 4000 + i % 60000))
    return tuple(out)


def sizes(n: int, hosts: str) -> dict:
    """Bytes of the frozen round key's value (as etcd stores it), of its participant list before
    deflating, and of what one node needs: the same round with only its own entry (its ranks,
    the world size, master, round and restart count).
    """
    from etcdrun.proto import etcdrun_state_pb2 as st
    from etcdrun.rendezvous.etcd.core import codec
    from etcdrun.rendezvous.etcd.core.protocol import Phase, Round

    ms = members(n, hosts)
    r = Round(7, Phase.FROZEN, ms, 2, ms[0].addr, 29500, run_lease=0x7E57_0000_0000_0001)
    value = codec.round_to(r)
    plain = codec.round_message(value, "/etcdrun/x/round", None)
    own = Round(7, Phase.FROZEN, (ms[n // 2],), 2, ms[0].addr, 29500, run_lease=r.run_lease)
    need = st.RoundState.FromString(codec.round_to(own))
    need.world_size = 8 * n  # the whole job's, as the full round says
    out = {
        "n": n,
        "hosts": hosts,
        "round_bytes": len(value),
        "plain_bytes": len(plain.SerializeToString()),
        "need_bytes": len(need.SerializeToString()),
    }
    return out | sharded_sizes(r)


def sharded_sizes(r) -> dict:
    """The same round written sharded (shards.py, whatever its size): the header every node
    watches and the shard each node gets by the watch of its shard key. ``shard_bytes`` is the
    shard a node gets, averaged over the nodes; ``sharded_bytes`` is what one round then costs
    etcd in all: N x header plus, for each shard, its size times the nodes that watch it.
    """
    from etcdrun.rendezvous.etcd.core import codec, shards

    whole = shards.shard(r, 2)
    header = codec.round_to(whole)
    parts = shards.split(whole)
    got = sum(len(ms) * len(codec.shard_to(whole, ms)) for ms in parts)
    n = len(r.members)
    return {
        "shards": len(parts),
        "header_bytes": len(header),
        "shard_bytes": got / n,
        "sharded_bytes": n * len(header) + got,
    }


def lines(ns: list[int]) -> list[str]:
    out = [
        "| N | hosts | round key value | participants undeflated | a node needs | N x value "
        "(watch events of one round) | N x need | sharded: S, header, mean shard | "
        "sharded: N x (header + shard) | of N x value |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        for hosts in ("one", "distinct"):
            s = sizes(n, hosts)
            out.append(
                f"| {n} | {hosts} | {s['round_bytes']:,} B | {s['plain_bytes']:,} B | "
                f"{s['need_bytes']} B | {n * s['round_bytes'] / 1e6:.1f} MB | "
                f"{n * s['need_bytes'] / 1e6:.2f} MB | {s['shards']}, {s['header_bytes']} B, "
                f"{s['shard_bytes']:,.0f} B | {s['sharded_bytes'] / 1e6:.2f} MB | "
                f"1/{n * s['round_bytes'] / s['sharded_bytes']:.0f} |"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1000,4096,8192", help="comma-separated participant counts")
    args = ap.parse_args(argv)
    try:
        ns = [int(x) for x in args.n.split(",") if x.strip()]
    except ValueError:
        ns = []
    if not ns or min(ns) < 1:
        print(f"bad --n {args.n!r}: integers >= 1", file=sys.stderr)
        return 2
    print("\n".join(lines(ns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
