# The "python" sandbox profile: python3 + a POSIX shell + coreutils, commands run as uid 10001.
# Built by `palaestra sandbox build-images` on top of the offline base (no RUN steps: the build
# has no network, and needs none).
ARG BASE
FROM ${BASE}
COPY runner.py seccomp.bpf /opt/palaestra/
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/work TMPDIR=/tmp LANG=C.UTF-8 PYTHONUTF8=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /work
CMD ["python3", "-I", "-S", "/opt/palaestra/runner.py", "init"]
