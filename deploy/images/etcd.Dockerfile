# etcd for etcdrun's compose cluster. BASE is any image with etcd and etcdctl on PATH: by default
# the rootfs build.py imports from this machine's Debian etcd (no shell, no package manager);
# where a registry exists, the official image (gcr.io/etcd-development/etcd:v3.5.x) works as is.
# Configuration comes from the command line (see deploy/docker-compose.yml).
ARG BASE=etcdrun/etcd-rootfs:latest
FROM ${BASE}
ENV PATH=/usr/local/bin:/usr/bin:/bin ETCDCTL_API=3
EXPOSE 2379 2380
CMD ["etcd"]
