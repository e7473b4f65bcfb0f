#!/usr/bin/env bash
# The compose stack's secrets, as files (docker-compose.yml mounts them at
# /run/secrets/<name>; their values are never in .env, the compose file, a
# command line or an environment variable):
#   secrets/redis_password     the stack's Redis password (requirepass; the
#                              engine reads it as remote_password_file)
#   secrets/kvbm_page_secret   the page secret: every disk and remote page is
#                              sealed with it (page_secret_file)
# Each is written only when missing or empty, 32 random bytes as 64 hex
# characters: a new page secret makes every page already stored unreadable (a
# miss, recomputed), so an existing one is kept. Then .env's REDIS_PASSWORD_FILE
# and PAGE_SECRET_FILE are set where they are empty or missing (after
# cp .env.example .env). Idempotent.
#
#   bash scripts/compose_secrets.sh
#
# KVBM_SECRETS_DIR (default secrets, in the checkout) and KVBM_ENV_FILE (default
# .env) name others. The directory is its owner's only (0700); the files in it
# are 0644, because a compose secret is a bind mount that keeps the host file's
# owner and mode, and the containers read it as their own users (kvbm, uid
# 10001; redis), which are not the host user who owns it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${KVBM_SECRETS_DIR:-secrets}
ENV_FILE=${KVBM_ENV_FILE:-.env}
[ -f "$ENV_FILE" ] || { echo "compose_secrets: no $ENV_FILE; first: cp .env.example $ENV_FILE" >&2; exit 1; }

umask 077
mkdir -p "$DIR"
chmod 700 "$DIR"
case "$DIR" in /*) REF=$DIR ;; *) REF=./${DIR#./} ;; esac

write_secret() {  # NAME: DIR/NAME, unless it already holds one
  local path="$DIR/$1"
  if [ -s "$path" ]; then
    echo "compose_secrets: $path exists; kept"
  else
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$path.tmp"
    mv "$path.tmp" "$path"
    echo "compose_secrets: wrote $path"
  fi
  chmod 644 "$path"
}

set_env() {  # VAR VALUE: VAR=VALUE in ENV_FILE where VAR is empty or missing
  if grep -q "^$1=." "$ENV_FILE"; then
    echo "compose_secrets: $ENV_FILE sets $1 already; kept"
  elif grep -q "^$1=\$" "$ENV_FILE"; then
    sed -i "s|^$1=\$|$1=$2|" "$ENV_FILE"
    echo "compose_secrets: $ENV_FILE: $1=$2"
  else
    printf '%s=%s\n' "$1" "$2" >> "$ENV_FILE"
    echo "compose_secrets: $ENV_FILE: $1=$2"
  fi
}

write_secret redis_password
write_secret kvbm_page_secret
set_env REDIS_PASSWORD_FILE "$REF/redis_password"
set_env PAGE_SECRET_FILE "$REF/kvbm_page_secret"
