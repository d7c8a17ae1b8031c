# Palaestra's inference side (embedded engine, sglang-router, gateway) for docker-compose.yml's
# cpu and gpu profiles: the host's python, the packages this environment has installed, the
# palaestra package. Built by `palaestra sandbox build-images app`: no RUN steps, no network.
ARG BASE
FROM ${BASE}
COPY root/ /
COPY site-packages /opt/palaestra/site-packages
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 PYTHONUTF8=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/opt/palaestra/site-packages
USER 10001:10001
WORKDIR /tmp
