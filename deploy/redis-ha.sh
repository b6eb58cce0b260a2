#!/bin/sh
# Start one node of a Redis set with failover: a data node (primary or replica) or a
# Sentinel, following the primary that the Sentinels name now (deploy/README.md, "Redis
# high availability"). The same script for Compose (compose/compose.ha.yaml) and
# Kubernetes (k8s/redis-ha.yaml, which holds a copy: tests/unit/test_deploy_ha.py checks
# that the two agree and runs this one with real redis-server processes).
#
#   redis-ha.sh data        # a data node: the primary on a first start if it is FIRST, else a replica
#   redis-ha.sh sentinel    # a Sentinel watching the set
#
# Environment:
#   SELF            this node's host name (or address) as the other nodes and the clients reach it
#   FIRST           host:port of the data node that is the primary on the set's first start
#   SENTINELS       the Sentinels, host:port, separated by spaces
#   SERVICE         the set's name at the Sentinels (the one in redis+sentinel://.../SERVICE/0)
#   REDIS_PASSWORD  the data nodes' password (user default), which the Sentinels require too;
#                   or, with ACL_SH set, the users of a run (deploy/README.md, "Redis ACL users"):
#   ACL_SH          deploy/redis/acl.sh: a data node loads the ACL file it prints (into DATA)
#                   from RUN and REDIS_PASSWORD_<ROLE>; it replicates as user `replica`
#                   (REDIS_PASSWORD_REPLICA), the Sentinels reach it as user `sentinel`
#                   (REDIS_PASSWORD_SENTINEL), this script as `admin` (REDIS_PASSWORD_ADMIN);
#                   SENTINEL_PASSWORD is the Sentinels' own, for their clients and one another
#   DATA            a writable folder (the data node's append-only file; the Sentinel's file)
#   CONF            the data nodes' redis.conf (deploy/redis.conf: append-only file, no eviction);
#                   each node its own copy, or read-only: a Sentinel rewrites a writable one
#   REDIS_PORT (6379), SENTINEL_PORT (26379), BIND (0.0.0.0), QUORUM (2),
#   DOWN_AFTER_MS (5000): how long a primary may not answer before the Sentinels fail it over
#   MIN_REPLICAS_TO_WRITE (1), MIN_REPLICAS_MAX_LAG (10): a data node that is the primary
#                   refuses writes (NOREPLICAS) while fewer replicas than that have answered
#                   within that many seconds: a primary cut off from the rest by a partition
#                   stops taking writes that the failover on the other side would throw away
#                   (deploy/README.md, "What is guaranteed"); 0: no such bound
set -eu
if [ -n "${ACL_SH:-}" ]; then
    SENTINEL_AUTH="$SENTINEL_PASSWORD"
    NODE_USER=admin
    SENTINEL_TO_NODE="${REDIS_PASSWORD_SENTINEL:-}"
    export REDISCLI_AUTH="${REDIS_PASSWORD_ADMIN:-}"  # redis-cli to this node; the Sentinels' below
else
    SENTINEL_AUTH="$REDIS_PASSWORD"
    NODE_USER=default
    SENTINEL_TO_NODE="$REDIS_PASSWORD"
    export REDISCLI_AUTH="$REDIS_PASSWORD"
fi
REDIS_PORT="${REDIS_PORT:-6379}"
SENTINEL_PORT="${SENTINEL_PORT:-26379}"
BIND="${BIND:-0.0.0.0}"

# "host port" of the primary that a Sentinel names (the others first: on a restart this
# node's own Sentinel may be starting too); FIRST's when none does (the set's first start,
# or every Sentinel down: then FIRST must hold the latest data, see deploy/README.md)
primary() {
    for sentinel in $SENTINELS; do
        answer=$(REDISCLI_AUTH="$SENTINEL_AUTH" timeout 3 redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" \
            --raw SENTINEL GET-MASTER-ADDR-BY-NAME "$SERVICE" 2>/dev/null | tr '\n' ' ') || answer=""
        set -- $answer
        if [ $# -eq 2 ]; then
            echo "$1 $2"
            return
        fi
    done
    echo "${FIRST%:*} ${FIRST##*:}"
}

# A replica that joins (a restart, a new node) holds nothing of the set until its first
# sync has ended, and a Sentinel would still promote it: a failover then, while the
# primary is slow to answer, would make an empty node the primary and empty the set. It
# starts unpromotable (replica-priority 0) and takes its configured priority once in sync
# (the Sentinels read it within 10 s). A primary lost before then is not failed over: the
# Sentinels try again after twice their failover-timeout, or it comes back.
promotable_once_in_sync() {
    host="${BIND%% *}"  # the first address it binds
    [ "$host" = "0.0.0.0" ] && host=127.0.0.1
    priority=$(awk '$1 == "replica-priority" { print $2 }' "$CONF")
    until timeout 3 redis-cli --user "$NODE_USER" -h "$host" -p "$REDIS_PORT" INFO replication 2>/dev/null \
        | grep -q '^master_link_status:up'; do
        sleep 1
    done
    timeout 3 redis-cli --user "$NODE_USER" -h "$host" -p "$REDIS_PORT" \
        CONFIG SET replica-priority "${priority:-100}" >/dev/null
}

case "${1:-}" in
data)
    set -- $(primary)
    if [ "$1" = "$SELF" ] && [ "$2" = "$REDIS_PORT" ]; then
        set --
    else
        set -- --replicaof "$1" "$2" --replica-priority 0
        promotable_once_in_sync &
    fi
    if [ -n "${ACL_SH:-}" ]; then
        sh "$ACL_SH" >"$DATA/users.acl"  # afresh at each start: the secrets may have changed
        set -- --aclfile "$DATA/users.acl" \
            --masteruser replica --masterauth "$REDIS_PASSWORD_REPLICA" "$@"
    else
        set -- --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" "$@"
    fi
    exec redis-server "$CONF" --port "$REDIS_PORT" --bind "$BIND" --dir "$DATA" \
        --replica-announce-ip "$SELF" --replica-announce-port "$REDIS_PORT" \
        --min-replicas-to-write "${MIN_REPLICAS_TO_WRITE:-1}" \
        --min-replicas-max-lag "${MIN_REPLICAS_MAX_LAG:-10}" "$@"
    ;;
sentinel)
    set -- $(primary)
    # written afresh at each start: what the Sentinels agree on now comes from the others
    cat >"$DATA/sentinel.conf" <<EOF
port $SENTINEL_PORT
bind $BIND
dir $DATA
requirepass $SENTINEL_AUTH
sentinel sentinel-pass $SENTINEL_AUTH
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $SELF
sentinel announce-port $SENTINEL_PORT
sentinel monitor $SERVICE $1 $2 ${QUORUM:-2}
sentinel auth-pass $SERVICE $SENTINEL_TO_NODE
sentinel down-after-milliseconds $SERVICE ${DOWN_AFTER_MS:-5000}
sentinel failover-timeout $SERVICE 60000
sentinel parallel-syncs $SERVICE 1
EOF
    if [ -n "${ACL_SH:-}" ]; then
        echo "sentinel auth-user $SERVICE sentinel" >>"$DATA/sentinel.conf"
    fi
    exec redis-server "$DATA/sentinel.conf" --sentinel
    ;;
*)
    echo "usage: redis-ha.sh data|sentinel" >&2
    exit 2
    ;;
esac
