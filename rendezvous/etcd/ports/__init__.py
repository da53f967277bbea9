"""The five ports one node's handler offers its agent (rendezvous/api.py: liveness, report,
hang, drain, progress), implemented on etcd, and the incarnation slot they follow (the node's
current session and driver). Above node/ and leader/: the report reads the leader's status and
last call, the drain port the signalled record. node_ports.py builds them together.
"""
