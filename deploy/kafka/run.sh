#!/bin/bash
# One Kafka node in KRaft mode, configured the way the apache/kafka image is: every KAFKA_FOO_BAR
# variable becomes the property foo.bar (KAFKA_LOG_DIRS → log.dirs). The storage is formatted on the
# first start (a random cluster id, or KAFKA_CLUSTER_ID) and kept on the volume across restarts.
#   JAVA_OPTS  the JVM's heap and collector (the local stack's: agentstream/stack/kafka.py)
set -euo pipefail
config="${KAFKA_CONFIG:-/tmp/server.properties}"
java=(java ${JAVA_OPTS:--Xms256m -Xmx512m -XX:+UseSerialGC} -Djava.awt.headless=true
      -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties -cp '/opt/kafka/libs/*')

: > "$config"
while IFS='=' read -r name value; do
  case "$name" in KAFKA_CLUSTER_ID|KAFKA_CONFIG) continue ;; esac
  key="${name#KAFKA_}"
  key="${key,,}"
  echo "${key//_/.}=$value" >> "$config"
done < <(env | grep '^KAFKA_[A-Z0-9_]*=' | sort)
grep -q '^process.roles=' "$config" || { echo "KAFKA_PROCESS_ROLES is not set: this image needs the KRaft settings as KAFKA_* variables" >&2; exit 2; }

log_dirs="$(sed -n 's/^log.dirs=//p' "$config")"
if [ ! -e "${log_dirs%%,*}/meta.properties" ]; then
  # a cluster id is 16 random bytes, URL-safe base64 without padding
  cluster_id="${KAFKA_CLUSTER_ID:-$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')}"
  "${java[@]}" kafka.tools.StorageTool format "--cluster-id=$cluster_id" -c "$config"
fi
exec "${java[@]}" kafka.Kafka "$config"
