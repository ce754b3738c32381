#!/usr/bin/env bash
# An MLflow tracking server with a SQL backend store and a local artifact root.
# Binds 127.0.0.1 unless MLFLOW_HOST is set. SQLite suits one user; for many concurrent trials on a
# cluster use PostgreSQL: BACKEND_STORE_URI=postgresql://user:pass@db:5432/mlflow (needs psycopg, in fedsweep's test extra).
#   infra/mlflow_server.sh            # http://127.0.0.1:5000, ./mlflow-server/mlflow.db
#   MLFLOW_TRACKING_URI=http://127.0.0.1:5000 fedsweep sweep sweeps/default.yaml
# MLFLOW_WORKERS: the server's worker processes (MLflow's default, 4, unless set).
# MLflow's job execution (a job runner and seven huey consumers, each a process with MLflow loaded, about 250 MB
# each, for its GenAI jobs and trace rollups) is off unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true: fedsweep runs
# no MLflow job; without them the server holds 8 fewer processes and answers /health sooner (docs/performance.md, section 9).
# MLflow's usage telemetry (its server and UI fetch a config from its makers' site, and report usage) is off unless
# MLFLOW_DISABLE_TELEMETRY=false, as in every fedsweep process (README, "MLflow").
set -euo pipefail
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
HOST="${MLFLOW_HOST:-127.0.0.1}"
PORT="${MLFLOW_PORT:-5000}"
DIR="${MLFLOW_SERVER_DIR:-$PWD/mlflow-server}"
mkdir -p "$DIR/artifacts"
BACKEND_STORE_URI="${BACKEND_STORE_URI:-sqlite:///$DIR/mlflow.db}"
exec mlflow server \
  --host "$HOST" --port "$PORT" \
  --backend-store-uri "$BACKEND_STORE_URI" \
  --artifacts-destination "$DIR/artifacts" \
  --serve-artifacts \
  ${MLFLOW_WORKERS:+--workers "$MLFLOW_WORKERS"}
