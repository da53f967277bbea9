"""etcdrun inside torch: the torchrun plugin (``--rdzv-backend etcd-v3``), its entry point,
torchrun's rdzv-conf keys read as ours, and ``EtcdStore``, a torch Store on etcd.

Only plugin.py and store.py import torch; entry.py and conf.py stay torch-free, so that torchrun
can list the backend without loading it.
"""
