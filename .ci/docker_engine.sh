# Sourced by .ci/run: a docker engine for the docker backend and compose tests (start_docker_engine),
# stopped afterwards only where nothing else uses it (stop_docker_engine).
# tests/palaestra/test_ci_script.py runs these functions with a stand-in docker command.

DOCKERD_LOG=/tmp/palaestra-ci-dockerd.log
DOCKERD_PID=""

# Where CI runs as root and no engine answers: install Debian's docker.io if dockerd is missing and
# start it without iptables or a default bridge (the sandbox containers have no network anyway;
# compose networks are internal). Anything that fails here only makes the docker tests skip, and
# they print why.
start_docker_engine() {
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo "[ci] docker engine: already answering"
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "[ci] docker engine: none answers and CI is not root; the docker tests will skip"
        return 0
    fi
    if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
        echo "[ci] docker engine: installing Debian's docker.io (apt-get)"
        if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io; } \
            >/tmp/palaestra-ci-apt.log 2>&1; then
            echo "[ci] docker engine: apt-get install docker.io failed (see /tmp/palaestra-ci-apt.log); docker tests will skip"
            tail -5 /tmp/palaestra-ci-apt.log
            return 0
        fi
    fi
    echo "[ci] docker engine: starting dockerd --iptables=false --bridge=none (log: $DOCKERD_LOG)"
    setsid dockerd --iptables=false --bridge=none >"$DOCKERD_LOG" 2>&1 </dev/null &
    DOCKERD_PID=$!
    for i in $(seq 1 60); do
        if docker info >/dev/null 2>&1; then
            echo "[ci] docker engine: up after ${i} s ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
            return 0
        fi
        if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
            break
        fi
        sleep 1
    done
    echo "[ci] docker engine: dockerd did not answer; the docker tests will skip. Its log ends:"
    tail -20 "$DOCKERD_LOG" || true
    return 0
}

# Stops the dockerd this run started, unless containers run on it that the tests did not leave
# (each test removes its own): then something else on the machine uses it, and it keeps running.
stop_docker_engine() {
    if [ -z "$DOCKERD_PID" ]; then
        return 0
    fi
    local running
    running=$(docker ps -q 2>/dev/null | wc -l)
    if [ "$running" -gt 0 ]; then
        echo "[ci] docker engine: left running (pid $DOCKERD_PID): $running container(s) run on it"
        return 0
    fi
    echo "[ci] docker engine: stopping the dockerd this run started"
    kill "$DOCKERD_PID" 2>/dev/null || true
}

