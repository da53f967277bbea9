"""The static backend (``--rdzv-backend static``, torchrun's default): a fixed-size job with
node ranks given up front and no etcd; the nodes meet on the master node first (barrier.py).
"""
