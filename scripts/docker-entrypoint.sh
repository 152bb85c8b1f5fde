#!/bin/sh
# Entrypoint of the fedcomp image. Nothing ever runs as root: started as root (compose does this,
# `user: root`, so that host files of any owner work), it prepares two things and then runs the
# command as an unprivileged uid with setpriv:
#  * the results folder (FEDCOMP_RESULTS, default /results): the command runs as its owner, i.e.
#    the host user who created ./results; a folder owned by root (Docker creates a missing bind
#    mount as root) is handed to the image's user `app` (uid 1000) first;
#  * secrets mounted read-only under /secrets (TLS certificates, SuperNode keys) are copied to
#    /run/fedcomp, readable by that uid only, whoever owns them on the host.
# Started as any other user: the results folder must be writable, else one clear line, exit 73.
set -eu
results=${FEDCOMP_RESULTS:-/results}
app_uid=$(id -u app); app_gid=$(id -g app)
if [ "$(id -u)" = 0 ]; then
  uid=$app_uid; gid=$app_gid
  if [ -d "$results" ]; then
    if [ "$(stat -c %u "$results")" = 0 ]; then
      chown app:app "$results"
    else
      uid=$(stat -c %u "$results"); gid=$(stat -c %g "$results")
    fi
  fi
  if [ "$uid" != "$app_uid" ]; then
    # a host uid without an account in the image: its own HOME (FLWR_HOME holds installed apps)
    export HOME="/tmp/home-$uid" FLWR_HOME="/tmp/home-$uid/.flwr"
    mkdir -p "$FLWR_HOME"
    if [ -f /home/app/.flwr/config.toml ]; then cp /home/app/.flwr/config.toml "$FLWR_HOME/"; fi
    chown -R "$uid:$gid" "$HOME"
  else
    export HOME=/home/app   # `user: root` made it /root
  fi
  if [ -d /secrets ]; then
    mkdir -p /run/fedcomp && cp -R /secrets/. /run/fedcomp/
    chown -R "$uid:$gid" /run/fedcomp && chmod -R go-rwx /run/fedcomp
  fi
  exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
fi
if [ -d "$results" ] && ! [ -w "$results" ]; then
  echo "fedcomp: the results folder $results is not writable by uid $(id -u) (owner uid" \
       "$(stat -c %u "$results")): chown it to that uid on the host, or start the container as root" \
       "(the entrypoint then runs the command as the folder's owner)" >&2
  exit 73
fi
exec "$@"
