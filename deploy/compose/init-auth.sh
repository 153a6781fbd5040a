#!/usr/bin/env bash
# One-shot (the auth-init service of both compose stacks): secure a new
# cluster's authentication and create dataferry's role. Runs in the database's
# own image, for its cqlsh, once every node is healthy.
#
#   1. On a new cluster, log in as the default superuser cassandra/cassandra
#      and give it CQL_ADMIN_PASSWORD.
#   2. Replicate system_auth like the data (NetworkTopologyStrategy, CQL_RF
#      in CQL_DC) and write the superuser's row again in the same session, so
#      every new replica holds it before anyone logs in again (Cassandra reads
#      that row at QUORUM). ScyllaDB 6 keeps roles in Raft-managed tables and
#      may refuse the ALTER: that is fine.
#   3. Create (or update the password of) the login role CQL_USER and grant it
#      CREATE ON ALL KEYSPACES: `dataferry schema apply`, run as that role,
#      creates the keyspace and so owns it (the creator of a keyspace gets all
#      permissions on it). If the keyspace already exists, grant them on it.
#
# Idempotent: a second run finds the admin password already set and repeats
# steps 2 and 3, which change nothing (or apply a new CQL_PASSWORD).
set -euo pipefail

: "${CQL_HOST:?the node to connect to}"
: "${CQL_ADMIN_PASSWORD:?set CASSANDRA_ADMIN_PASSWORD in .env}"
: "${CQL_USER:?set CASSANDRA_USER in .env}"
: "${CQL_PASSWORD:?set CASSANDRA_PASSWORD in .env}"
: "${CQL_DC:?the datacenter name}"
: "${CQL_RF:?the replication factor in that datacenter}"
CQL_PORT=${CQL_PORT:-9042}
CQL_KEYSPACE=${CQL_KEYSPACE:-dataferry}
# seconds to wait for the default superuser (created a few seconds after the
# first node starts)
CQL_WAIT=${CQL_WAIT:-300}
CQL_POLL=${CQL_POLL:-5}

die() { echo "init-auth: $*" >&2; exit 1; }

[[ $CQL_USER =~ ^[a-z][a-z0-9_]{0,47}$ ]] || die "CASSANDRA_USER must be lower-case letters, digits and _ (got '$CQL_USER')"
[[ $CQL_KEYSPACE =~ ^[A-Za-z][A-Za-z0-9_]{0,47}$ ]] || die "bad keyspace name '$CQL_KEYSPACE'"
[[ $CQL_DC =~ ^[A-Za-z0-9_-]+$ ]] || die "bad datacenter name '$CQL_DC'"
[[ $CQL_RF =~ ^[1-9][0-9]?$ ]] || die "bad replication factor '$CQL_RF'"
[[ $CQL_ADMIN_PASSWORD != cassandra ]] || die "CASSANDRA_ADMIN_PASSWORD must not be the default 'cassandra'"
[[ $CQL_USER != cassandra ]] || die "CASSANDRA_USER must not be the superuser 'cassandra'"

# lit TEXT: TEXT as a CQL string literal ('' escapes ')
lit() { printf "'%s'" "${1//\'/\'\'}"; }

# cql USER PASSWORD STATEMENTS
cql() {
    cqlsh "$CQL_HOST" "$CQL_PORT" -u "$1" -p "$2" --connect-timeout=10 --request-timeout=60 -e "$3"
}

can_login() { cql "$1" "$2" "SELECT release_version FROM system.local;" > /dev/null 2>&1; }

deadline=$((SECONDS + CQL_WAIT))
while :; do
    if can_login cassandra "$CQL_ADMIN_PASSWORD"; then
        fresh=0
        break
    fi
    if can_login cassandra cassandra; then
        fresh=1
        break
    fi
    ((SECONDS < deadline)) || die "cannot log in to $CQL_HOST:$CQL_PORT as cassandra after ${CQL_WAIT}s (is authentication on, and the admin password the one set before?)"
    echo "init-auth: waiting for the superuser on $CQL_HOST:$CQL_PORT" >&2
    sleep "$CQL_POLL"
done

admin=$(lit "$CQL_ADMIN_PASSWORD")
if ((fresh)); then
    echo "init-auth: new cluster: setting the superuser's password" >&2
    cql cassandra cassandra "ALTER ROLE cassandra WITH PASSWORD = $admin;"
fi

replication="{'class': 'NetworkTopologyStrategy', '$CQL_DC': '$CQL_RF'}"
if ! cql cassandra "$CQL_ADMIN_PASSWORD" "ALTER KEYSPACE system_auth WITH replication = $replication;
ALTER ROLE cassandra WITH PASSWORD = $admin;"; then
    echo "init-auth: note: system_auth replication not changed (ScyllaDB 6 keeps roles in Raft)" >&2
fi

pw=$(lit "$CQL_PASSWORD")
cql cassandra "$CQL_ADMIN_PASSWORD" "CREATE ROLE IF NOT EXISTS $CQL_USER WITH PASSWORD = $pw AND LOGIN = true;
ALTER ROLE $CQL_USER WITH PASSWORD = $pw AND LOGIN = true;
GRANT CREATE ON ALL KEYSPACES TO $CQL_USER;"

if cql cassandra "$CQL_ADMIN_PASSWORD" "DESCRIBE KEYSPACE $CQL_KEYSPACE;" > /dev/null 2>&1; then
    cql cassandra "$CQL_ADMIN_PASSWORD" "GRANT ALL PERMISSIONS ON KEYSPACE $CQL_KEYSPACE TO $CQL_USER;"
fi

can_login "$CQL_USER" "$CQL_PASSWORD" || die "role $CQL_USER was created but cannot log in"
echo "init-auth: role $CQL_USER ready on $CQL_HOST ($CQL_DC: RF $CQL_RF)" >&2
