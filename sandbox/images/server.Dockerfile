# The exec server the compose fleet runs (docker-compose.yml, service `sandbox`), and the small
# front that forwards the host's loopback to the replicas' unix sockets (service `sandbox-front`).
# Built by `palaestra sandbox build-images` on top of the offline base: no RUN steps, no network.
ARG BASE
FROM ${BASE}
COPY runner.py seccomp.bpf /opt/palaestra/
COPY site-packages /opt/palaestra/site-packages
COPY root/ /
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 PYTHONUTF8=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/opt/palaestra/site-packages
USER 10001:10001
WORKDIR /tmp
