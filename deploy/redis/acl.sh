#!/bin/sh
# The Redis ACL users of one rollstream run, one per role: the one place their rules are
# written (deploy/README.md, "Redis ACL users"). Prints an ACL file for redis-server's
# --aclfile; every layout runs it when Redis starts, from the passwords of its secrets:
#
#   RUN=exp1 REDIS_PASSWORD_ADMIN=... REDIS_PASSWORD_PRODUCER=... sh acl.sh > users.acl
#   redis-server redis.conf --aclfile users.acl
#
# Environment:
#   RUN                        the run's name: every run user reaches only rs:{RUN}:* (and
#                              rq's keys, which rollstream keeps there too)
#   REDIS_PASSWORD_<ROLE>      each user's password, ROLE one of ADMIN PRODUCER TRAINER
#                              FEEDER ENGINES JUDGE ARCHIVE METRICS MONITOR EXPORTER, and REPLICA and
#                              SENTINEL for a set with failover (deploy/redis-ha.sh); a user
#                              whose password is unset is left out. Only its SHA-256 lands
#                              in the file.
#   ACL_ROLES                  print only these users' rules, no passwords (the tests read it)
#
# The user `default` (no name in the URL) is the admin: the admin's password and rules.
# It cannot be turned off: Redis replays the append-only file as `default`, and before
# Redis 8.4 EXEC checks ACL rules again during that replay, so with `default` off every
# MULTI/EXEC of the file (every rollstream script's writes: settles, commits, counters)
# is refused and silently left out when Redis restarts (redis/redis#14541, fixed by
# redis/redis#14545). Every rollstream process names its user all the same.
set -eu

# Commands every rollstream process uses (docs/engines.md's list): no @admin, no
# @dangerous (KEYS, FLUSHALL, CONFIG, DEBUG, ...), TIME for heartbeats and leases on the
# server's clock; INFO is not needed (`rollstream check` reads HELLO).
PROCESS="-@all +@read +@write +@stream +@hash +@string +@set +@list +@sortedset +@scripting \
+@transaction +@connection +@keyspace +@pubsub -@dangerous +time"

rules() {
    k="rs:{$RUN}"
    case "$1" in
    # operators: everything (ACL, CONFIG, SENTINEL failovers by hand, redis-cli)
    admin) echo "~* &* +@all" ;;
    # claims prompts (XREADGROUP on the pools), appends groups, eval results, dead letters
    # and filtered records, its heartbeat in the run's state, rq's judge queue; reads the rest
    producer) echo "$PROCESS &$k:rq:* %R~$k:* ~$k:evals:* ~$k:prompts:* ~$k:aborted:* \
~$k:expired:* ~$k:groups:* ~$k:eval:* ~$k:dead ~$k:filtered ~$k:state ~$k:progress \
~$k:fence:* ~$k:batch:* ~$k:metrics ~$k:rq:* ~$k:alive:producer:*" ;;
    # the run's owner: reads, commits and expires groups, publishes weight syncs and
    # events, per-step metrics, the trained log; not rq's keys, not others' heartbeats
    trainer) echo "$PROCESS %R~$k:* ~$k:evals:* ~$k:prompts:* ~$k:aborted:* ~$k:expired:* \
~$k:groups:* ~$k:eval:* ~$k:batch:* ~$k:adapter:* ~$k:events ~$k:dead ~$k:filtered \
~$k:trained:* ~$k:state ~$k:progress ~$k:metrics ~$k:fed:* ~$k:fence:* ~$k:alive:trainer:*" ;;
    # appends prompts (and eval prompts), their uids, its cursor; never a group
    feeder) echo "$PROCESS %R~$k:* ~$k:prompts:* ~$k:evals:* ~$k:fed:* ~$k:batch:* \
~$k:state ~$k:progress ~$k:alive:feeder:*" ;;
    # records the Ray cluster in the run's state, its heartbeat
    engines) echo "$PROCESS %R~$k:* ~$k:state ~$k:alive:engines:*" ;;
    # an rq worker for the run: rq's keys and channels, its heartbeat
    judge) echo "$PROCESS &$k:rq:* %R~$k:* ~$k:rq:* ~$k:alive:judge:*" ;;
    # reads the trained log, dead letters and filtered records in its consumer group, and
    # deletes each trained group (kept in the groups stream for it) once archived
    archive) echo "$PROCESS %R~$k:* ~$k:trained:* ~$k:groups:* ~$k:dead ~$k:filtered \
~$k:alive:archiver:*" ;;
    # reads everything of the run; writes only its own heartbeat key (which expires by
    # itself), so that `rollstream status` lists it like every other process
    metrics) echo "$PROCESS %R~$k:* ~$k:alive:metrics:*" ;;
    # KEDA's Redis Streams scaler and monitoring: the length, groups and pending
    # entries of the run's streams, nothing else
    monitor) echo "-@all +ping +hello +client|setname +xlen +xinfo|stream \
+xinfo|groups +xinfo|consumers +xpending %R~$k:evals:* %R~$k:prompts:* %R~$k:aborted:* \
%R~$k:expired:* %R~$k:groups:*" ;;
    # the Redis exporter (Prometheus): Redis's own figures (INFO, its configuration's
    # maxmemory, slow log, latency, the key count), no key of any run
    exporter) echo "-@all +ping +hello +auth +info +config|get +client|list +slowlog|get \
+slowlog|len +latency|latest +dbsize +select +cluster|info +memory|stats" ;;
    # a replica's link to its primary (masteruser)
    replica) echo "-@all +psync +replconf +ping" ;;
    # a Sentinel's link to every data node (sentinel auth-user): Redis's documented set
    sentinel) echo "-@all &* +multi +slaveof +ping +exec +subscribe +config|rewrite +role \
+publish +info +client|setname +client|kill +script|kill" ;;
    *)
        echo "acl.sh: unknown role $1" >&2
        exit 2
        ;;
    esac
}

ROLES="admin producer trainer feeder engines judge archive metrics monitor exporter replica sentinel"

: "${RUN:?set RUN to the run's name}"
case "$RUN" in
[A-Za-z0-9]*) ;;
*) echo "acl.sh: invalid run name '$RUN': letters, digits, '_', '.', '-' (a letter or digit first)" >&2; exit 2 ;;
esac
case "$RUN" in
*[!A-Za-z0-9_.-]*) echo "acl.sh: invalid run name '$RUN': letters, digits, '_', '.', '-' only" >&2; exit 2 ;;
esac

if [ -n "${ACL_ROLES:-}" ]; then
    for role in $ACL_ROLES; do
        echo "$role $(rules "$role")"
    done
    exit 0
fi

: "${REDIS_PASSWORD_ADMIN:?set REDIS_PASSWORD_ADMIN: the admin's password is also the default user's}"
hash=$(printf '%s' "$REDIS_PASSWORD_ADMIN" | sha256sum | cut -d' ' -f1)
echo "user default on #$hash resetchannels $(rules admin)"
for role in $ROLES; do
    var="REDIS_PASSWORD_$(echo "$role" | tr '[:lower:]' '[:upper:]')"
    eval "password=\${$var:-}"
    [ -n "$password" ] || continue
    hash=$(printf '%s' "$password" | sha256sum | cut -d' ' -f1)
    echo "user $role on #$hash resetchannels $(rules "$role")"
done
