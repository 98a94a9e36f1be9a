#!/usr/bin/env bash
# Local services of SAGE Studio: a real Prefect server, the MLflow UI, and the process serving the deployments.
#
#   flows/services.sh up        start all three in the background (pid files + logs in $SAGE_HOME/run), wait for health;
#                               with SAGE_SERVICES=compose, `docker compose -f docker/compose.yaml up -d` instead
#                               (its Postgres-backed servers and a GPU worker)
#   flows/services.sh down      stop what `up` started (by pid file, process group), nothing else
#   flows/services.sh status    what is running
#   flows/services.sh env       export lines for your shell:  eval "$(flows/services.sh env)"
#   flows/services.sh run DEPLOYMENT [prefect deployment run args...]   run a deployment and --watch it
#   flows/services.sh report    the report card of the latest hint-study (flows/report.py)
#   flows/services.sh serve     serve the deployments in the foreground (needs a running server)
#   flows/services.sh mlflow-ui run the MLflow UI in the foreground
#
# Environment: SAGE_HOME (default <repo>/.sage), BIN (default <repo>/.venv/bin), PREFECT_HOST/PREFECT_PORT
# (127.0.0.1:4200), MLFLOW_HOST/MLFLOW_PORT (127.0.0.1:5000), MLFLOW_BACKEND_URI (default the flows' sqlite store),
# SERVE_ARGS (extra args for `python -m flows.serve`), WAIT_DEPLOYMENT (the deployment `up` waits for, default the
# first one serve names), SERVICES_TIMEOUT (seconds to wait for health, default 300).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BIN:-$ROOT/.venv/bin}"
case "$BIN" in /*) ;; *) BIN="$ROOT/$BIN" ;; esac
SAGE_HOME="${SAGE_HOME:-$ROOT/.sage}"
mkdir -p "$SAGE_HOME"
SAGE_HOME="$(cd "$SAGE_HOME" && pwd)"
RUN="$SAGE_HOME/run"
PREFECT_HOST="${PREFECT_HOST:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_HOST="${MLFLOW_HOST:-127.0.0.1}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
TIMEOUT="${SERVICES_TIMEOUT:-300}"

export SAGE_HOME
export PREFECT_HOME="${PREFECT_HOME:-$SAGE_HOME/prefect}"
export PREFECT_API_URL="http://$PREFECT_HOST:$PREFECT_PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_RUNNER_POLL_FREQUENCY="${PREFECT_RUNNER_POLL_FREQUENCY:-5}"
export PREFECT_LOGGING_EXTRA_LOGGERS="${PREFECT_LOGGING_EXTRA_LOGGERS:-sage_core}"
export SAGE_MLFLOW_UI_URL="http://$MLFLOW_HOST:$MLFLOW_PORT"
export MLFLOW_PORT PREFECT_PORT
MLFLOW_BACKEND_URI="${MLFLOW_BACKEND_URI:-${MLFLOW_TRACKING_URI:-sqlite:///$SAGE_HOME/mlflow.db}}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false

say() { printf '[sage services] %s\n' "$*"; }

started() {  # started PID: when the process began (a pid and its start time name one process: pids are reused)
  ps -o lstart= -p "$1" 2>/dev/null || true
}

pid_of() {  # pid_of NAME: the pid in $RUN/NAME.pid, where the process `up` started there still runs (a pid file
  # left by a reboot or a crash can name another program that has the pid now: that one is not ours to stop)
  local f="$RUN/$1.pid" pid="" when=""
  [[ -f "$f" ]] || return 1
  { read -r pid || true; read -r when || true; } < "$f"
  kill -0 "$pid" 2>/dev/null || return 1
  if [[ -n "$when" && "$(started "$pid")" != "$when" ]]; then return 1; fi
  echo "$pid"
}

alive() {  # alive NAME: the process in $RUN/NAME.pid runs
  pid_of "$1" >/dev/null
}

port_busy() {  # port_busy HOST PORT
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

start_bg() {  # start_bg NAME CMD...: own session (process group) so `down` stops its children too
  local name="$1"; shift
  if alive "$name"; then say "$name already running (pid $(pid_of "$name"))"; return 0; fi
  mkdir -p "$RUN"
  (cd "$ROOT" && exec setsid "$@" >"$RUN/$name.log" 2>&1 < /dev/null) &
  printf '%s\n%s\n' "$!" "$(started "$!")" > "$RUN/$name.pid"
  say "$name started (pid $!, log $RUN/$name.log)"
}

wait_http() {  # wait_http NAME URL
  local name="$1" url="$2" t0=$SECONDS t=0
  while (( t < TIMEOUT )); do
    if "$BIN/python" - "$url" <<'EOF' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
    then say "$name healthy: $url (${t}s)"; return 0; fi
    if ! alive "$name"; then say "$name exited; last lines of $RUN/$name.log:"; tail -n 30 "$RUN/$name.log" >&2; return 1; fi
    sleep 2; t=$((SECONDS - t0))  # seconds, not tries: a try takes time too
  done
  say "$name not healthy after ${TIMEOUT}s ($url); see $RUN/$name.log"; return 1
}

wait_deployment() {  # wait until the serve process has registered DEPLOYMENT (empty: the first one it serves)
  local dep="$1" t0=$SECONDS t=0
  while (( t < TIMEOUT )); do
    # `python -m flows.serve` first prints what it serves (SERVE_ARGS may leave hint-study out)
    [[ -n "$dep" ]] || dep="$(sed -n 's/^serving: \([^,]*\).*/\1/p' "$RUN/serve.log" 2>/dev/null | head -n 1)"
    # this serve's own start line (serve.log is rewritten per start): a deployment left in the database by an
    # earlier serve is there already, and would pass for one served by a process that died on start
    if [[ -n "$dep" ]] && grep -q "being served" "$RUN/serve.log" 2>/dev/null && alive serve \
       && "$BIN/prefect" deployment inspect "$dep" >/dev/null 2>&1; then say "deployment $dep ready (${t}s)"; return 0; fi
    if ! alive serve; then say "serve exited; last lines of $RUN/serve.log:"; tail -n 30 "$RUN/serve.log" >&2; return 1; fi
    sleep 2; t=$((SECONDS - t0))
  done
  say "deployment ${dep:-of serve} not registered after ${TIMEOUT}s; see $RUN/serve.log"; return 1
}

stop() {  # stop NAME: TERM the process group, then KILL after 20 s
  local name="$1" f="$RUN/$1.pid" pid t=0
  [[ -f "$f" ]] || return 0
  if pid="$(pid_of "$name")"; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && (( t < 20 )); do sleep 1; t=$((t + 1)); done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; fi
    say "$name stopped (pid $pid)"
  fi
  rm -f "$f"
}

use_compose() {  # SAGE_SERVICES=local|compose (default local: the compose worker reserves an NVIDIA GPU, and the
  # demo's sqlite store and local Prefect need no Docker)
  case "${SAGE_SERVICES:-local}" in
    local) return 1 ;;
    compose)
      command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1 \
        || { say "SAGE_SERVICES=compose needs a running Docker engine with the compose plugin"; exit 1; } ;;
    *) say "SAGE_SERVICES=${SAGE_SERVICES}: use local or compose"; exit 2 ;;
  esac
}

COMPOSE=(docker compose -f "$ROOT/docker/compose.yaml")

cmd_up() {
  mkdir -p "$RUN" "$PREFECT_HOME" "$SAGE_HOME/mlartifacts"
  if use_compose; then
    say "SAGE_SERVICES=compose: starting the compose stack"
    "${COMPOSE[@]}" up -d --wait
    touch "$RUN/compose"
    say "Prefect UI http://127.0.0.1:4200   MLflow UI http://127.0.0.1:5000   dashboard http://127.0.0.1:8501"
    return
  fi
  if ! alive prefect && port_busy "$PREFECT_HOST" "$PREFECT_PORT"; then
    say "port $PREFECT_PORT is in use by another program; set PREFECT_PORT=..."; exit 1; fi
  if ! alive mlflow && port_busy "$MLFLOW_HOST" "$MLFLOW_PORT"; then
    say "port $MLFLOW_PORT is in use by another program; set MLFLOW_PORT=..."; exit 1; fi
  start_bg prefect "$BIN/prefect" server start --host "$PREFECT_HOST" --port "$PREFECT_PORT" --analytics-off
  start_bg mlflow env MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$BIN/mlflow" server \
    --backend-store-uri "$MLFLOW_BACKEND_URI" --artifacts-destination "$SAGE_HOME/mlartifacts" \
    --host "$MLFLOW_HOST" --port "$MLFLOW_PORT" --workers 1
  wait_http prefect "$PREFECT_API_URL/health"
  wait_http mlflow "$SAGE_MLFLOW_UI_URL/health"
  # shellcheck disable=SC2086
  start_bg serve "$BIN/python" -m flows.serve ${SERVE_ARGS:-}
  wait_deployment "${WAIT_DEPLOYMENT:-}"
  say "Prefect UI  $PREFECT_API_URL (UI: http://$PREFECT_HOST:$PREFECT_PORT)"
  say "MLflow UI   $SAGE_MLFLOW_UI_URL   (store $MLFLOW_BACKEND_URI)"
  say "run:        PREFECT_API_URL=$PREFECT_API_URL $BIN/prefect deployment run sage-train/tiny-cpu --watch"
}

cmd_down() {
  if [[ -f "$RUN/compose" ]]; then "${COMPOSE[@]}" down && rm -f "$RUN/compose"; return; fi
  stop serve
  stop mlflow
  stop prefect
}

cmd_status() {
  local n
  for n in prefect mlflow serve; do
    if alive "$n"; then say "$n running (pid $(pid_of "$n"))"; else say "$n not running"; fi
  done
}

cmd_env() {
  printf 'export SAGE_HOME=%q\nexport PREFECT_HOME=%q\nexport PREFECT_API_URL=%q\nexport SAGE_MLFLOW_UI_URL=%q\n' \
    "$SAGE_HOME" "$PREFECT_HOME" "$PREFECT_API_URL" "$SAGE_MLFLOW_UI_URL"
}

cmd_run() {
  [[ $# -ge 1 ]] || { say "usage: services.sh run FLOW/DEPLOYMENT [args]"; exit 2; }
  [[ -f "$RUN/compose" ]] || alive serve || { say "the deployments are not served: run 'make up' first"; exit 1; }
  cd "$ROOT" && exec "$BIN/prefect" deployment run "$@" --watch
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  run) shift; cmd_run "$@" ;;
  report) shift
    # the compose stack's runs are in its MLflow server, not in the local sqlite store
    if [[ -f "$RUN/compose" ]]; then export MLFLOW_TRACKING_URI="http://127.0.0.1:5000"; fi
    cd "$ROOT" && exec "$BIN/python" -m flows.report "$@" ;;
  serve) shift; cd "$ROOT" && exec "$BIN/python" -m flows.serve "$@" ;;
  mlflow-ui) cd "$ROOT" && exec env MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$BIN/mlflow" server \
      --backend-store-uri "$MLFLOW_BACKEND_URI" --artifacts-destination "$SAGE_HOME/mlartifacts" \
      --host "$MLFLOW_HOST" --port "$MLFLOW_PORT" --workers 1 ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
