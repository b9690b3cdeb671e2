#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on loopback for the test suite: start installed
# services that are stopped, install them with apt-get when missing (as root), and
# otherwise say exactly what to do. Then create the test database.
set -euo pipefail

PG_HOST=127.0.0.1 PG_PORT=5432 REDIS_PORT=6379
TEST_DB=${TOLLGATE_TEST_DB:-tollgate_test}
export PGPASSWORD=${PGPASSWORD:-postgres}

say() { echo "services: $*"; }
die() { echo "services: $*" >&2; exit 1; }
is_root() { [ "$(id -u)" -eq 0 ]; }

apt_install() {
  is_root || die "$1 is missing. Install it (sudo apt-get install -y $*) or run make test as root."
  say "installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_up() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT" 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; }

wait_for() {  # wait_for NAME CHECK: poll a readiness probe, bounded
  for _ in $(seq 1 60); do "$2" && return 0; sleep 0.5; done
  die "$1 did not come up on loopback"
}

ensure_postgres() {
  pg_up && return 0
  command -v pg_ctlcluster >/dev/null 2>&1 || apt_install postgresql postgresql-client
  local version
  version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)
  [ -n "$version" ] || die "PostgreSQL is installed but has no cluster (try: pg_createcluster --start 15 main)"
  say "starting PostgreSQL $version"
  if is_root || [ "$(id -un)" = postgres ]; then
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  else
    die "PostgreSQL is stopped. Start it: sudo pg_ctlcluster $version main start"
  fi
  wait_for PostgreSQL pg_up
  # A fresh Debian cluster asks for a password on TCP: give the postgres role the one we use.
  if is_root; then
    su postgres -c "psql -q -c \"ALTER USER postgres PASSWORD '$PGPASSWORD'\"" >/dev/null 2>&1 || true
  fi
}

ensure_redis() {
  redis_up && return 0
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server
  say "starting Redis"
  mkdir -p /tmp/tollgate-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" \
    --appendonly no --dir /tmp/tollgate-redis --logfile /tmp/tollgate-redis/redis.log
  wait_for Redis redis_up
}

ensure_test_database() {
  local psql=(psql -q -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -tA)
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$TEST_DB'")" != 1 ]; then
    say "creating database $TEST_DB"
    "${psql[@]}" -c "CREATE DATABASE $TEST_DB"
  fi
}

ensure_postgres
ensure_redis
ensure_test_database
say "PostgreSQL on $PG_HOST:$PG_PORT (database $TEST_DB) and Redis on 127.0.0.1:$REDIS_PORT are up"
