#!/usr/bin/env bash
# Entrypoint for the official cassandra image (deploy/compose/cassandra.yaml):
# turn on password authentication and role-based authorization in
# cassandra.yaml, then hand over to the image's own docker-entrypoint.sh,
# which applies the CASSANDRA_* variables (seeds, cluster name, DC, snitch).
#
# The image configures only a few settings from the environment and the
# authenticator is not one of them. cassandra.yaml writes it as
#   authenticator: AllowAllAuthenticator                  (Cassandra <= 4.1)
# or as
#   authenticator:
#     class_name: AllowAllAuthenticator                   (Cassandra 5)
# so both forms are rewritten, and the result is checked: an unknown layout
# stops the container instead of starting a cluster without authentication.
#
# CASSANDRA_YAML overrides the file (tests use it); with arguments "--check"
# only the rewrite runs.
set -euo pipefail

conf=${CASSANDRA_YAML:-${CASSANDRA_CONF:-/etc/cassandra}/cassandra.yaml}

die() { echo "cassandra-entrypoint: $*" >&2; exit 1; }

# set_class KEY CLASS: make KEY's class CLASS, in either layout.
set_class() {
    local key=$1 cls=$2 tmp
    tmp=$(mktemp)
    if grep -Eq "^${key}:[[:space:]]*$" "$conf"; then
        # nested: the first class_name after the key's line
        sed -E "/^${key}:[[:space:]]*$/,/^[[:space:]]+class_name[[:space:]]*:/ s/^([[:space:]]+class_name[[:space:]]*:[[:space:]]*).*/\\1${cls}/" \
            "$conf" > "$tmp"
    elif grep -Eq "^${key}:[[:space:]]*[^[:space:]#]" "$conf"; then
        sed -E "s/^${key}:.*/${key}: ${cls}/" "$conf" > "$tmp"
    else
        rm -f "$tmp"
        die "no '${key}:' setting in ${conf}; cannot turn on authentication"
    fi
    # write in place (cat, not mv: the file may be a bind mount)
    cat "$tmp" > "$conf"
    rm -f "$tmp"
    # check: the key (or its class_name line right below it) now names CLASS
    grep -Eq "^${key}:[[:space:]]*(org\.apache\.cassandra\.auth\.)?${cls}[[:space:]]*$" "$conf" \
        || grep -A1 -E "^${key}:[[:space:]]*$" "$conf" \
            | grep -Eq "^[[:space:]]+class_name[[:space:]]*:[[:space:]]*${cls}[[:space:]]*$" \
        || die "could not set ${key} to ${cls} in ${conf}"
}

[[ -f $conf ]] || die "${conf} not found"
set_class authenticator PasswordAuthenticator
set_class authorizer CassandraAuthorizer
echo "cassandra-entrypoint: ${conf}: PasswordAuthenticator, CassandraAuthorizer" >&2

if [[ ${1:-} == --check ]]; then
    exit 0
fi
exec docker-entrypoint.sh "$@"
