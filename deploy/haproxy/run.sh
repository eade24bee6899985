#!/usr/bin/env bash
# Two loraplex replicas behind HAProxy on one host (for a try-out; on Kubernetes use deploy/kubernetes/).
# Both replicas share PostgreSQL, Redis and the adapter folder, so they act as one service; a Celery worker
# validates uploads. Needs LORAPLEX_DATABASE_URL (PostgreSQL, migrated: loraplex db upgrade) and
# LORAPLEX_REDIS_URL in the environment, and haproxy (apt-get install haproxy).
#
#   LORAPLEX_DATABASE_URL=postgresql+psycopg://... LORAPLEX_REDIS_URL=redis://127.0.0.1:6379/0 deploy/haproxy/run.sh
#
# Clients use http://127.0.0.1:8000 (LB_PORT); the replicas listen on 8001 and 8002. Ctrl-C stops everything.
set -euo pipefail
: "${LORAPLEX_DATABASE_URL:?set LORAPLEX_DATABASE_URL (PostgreSQL)}"
: "${LORAPLEX_REDIS_URL:?set LORAPLEX_REDIS_URL}"
HERE="$(cd "$(dirname "$0")" && pwd)"
LORAPLEX="${LORAPLEX:-loraplex}"
LB_PORT="${LB_PORT:-8000}"
export LORAPLEX_ADAPTER_STORAGE_DIR="${LORAPLEX_ADAPTER_STORAGE_DIR:-$PWD/data/adapters}"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM

for i in 1 2; do
    # Each replica names itself in session records, so a turn that lands on the other one is counted as moved.
    LORAPLEX_REPLICA_ID="replica-$i" LORAPLEX_PORT="$((LB_PORT + i))" "$LORAPLEX" serve &
    pids+=($!)
done
celery -A loraplex.platform.celery_app:celery worker --loglevel=INFO &
pids+=($!)

export LORAPLEX_LB_BIND="127.0.0.1:$LB_PORT" LORAPLEX_LB_LOG=stdout
export LORAPLEX_REPLICA_1="127.0.0.1:$((LB_PORT + 1))" LORAPLEX_REPLICA_2="127.0.0.1:$((LB_PORT + 2))"
haproxy -W -db -f "$HERE/haproxy.cfg" &
pids+=($!)
wait -n
