# The etcdrun agent: a venv at /opt/etcdrun with etcdrun and its dependencies, installed from
# the wheels build.py put in the context (pip --no-index: nothing is fetched at build time), and
# the examples in /opt/etcdrun/examples. BASE is any image with python3 and its venv module: by
# default the Debian rootfs build.py makes with debootstrap; where a registry exists,
# python:3.11-slim. Two stages, so the wheels never end up in a layer of the image.
ARG BASE=etcdrun/debian:latest
FROM ${BASE} AS install
COPY wheels/ /tmp/wheels/
RUN python3 -m venv /opt/etcdrun \
 && /opt/etcdrun/bin/pip install --no-index --no-cache-dir --disable-pip-version-check \
      --find-links /tmp/wheels /tmp/wheels/*.whl

FROM ${BASE}
COPY --from=install /opt/etcdrun /opt/etcdrun
COPY examples/ /opt/etcdrun/examples/
ENV PATH=/opt/etcdrun/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1
WORKDIR /opt/etcdrun
# SIGTERM (docker stop, Kubernetes): a graceful leave, exit 0 after a drain above min nodes, or
# 143 after forwarding it to the workers (docs/deploy.md).
STOPSIGNAL SIGTERM
CMD ["etcdrun", "--help"]
