# Helpers shared by start.sh (fake nodes) and real-nodes.sh; sourced after `dir` is set.

log() { echo "[cluster] $(date +%H:%M:%S) $*"; }
# the reason again last: the logs' tails before it would bury it in a caller's last-N-bytes view
die() { echo "[cluster] $*" >&2; tail -n 30 "$dir"/logs/*.log >&2 || true; bash "$here/stop.sh" "$dir" >&2
        echo "[cluster] failed: $*" >&2; exit 1; }

start() {  # start NAME CMD...: background, logged, pid recorded for stop.sh, command kept for restart.sh
  local name="$1"; shift
  mkdir -p "$dir/cmd"
  printf '%q ' "$(command -v "$1")" "${@:2}" >"$dir/cmd/$name"
  nohup "$@" >>"$dir/logs/$name.log" 2>&1 &
  echo $! >"$dir/pids/$name.pid"
}

wait_for() {  # wait_for SECONDS WHAT CMD...
  local t="$1" what="$2"; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || die "timed out after ${t}s waiting for $what"
    sleep 0.3
  done
}

# --- certificates: one CA signs everything ----------------------------------------------------------
c="$dir/certs"
ossl() { openssl "$@" 2>>"$dir/logs/openssl.log"; }
newkey() { ossl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1"; }
sign() {  # sign NAME SUBJECT EXTENSIONS
  newkey "$c/$1.key"
  ossl req -new -key "$c/$1.key" -subj "$2" -out "$c/$1.csr"
  ossl x509 -req -in "$c/$1.csr" -CA "$c/ca.crt" -CAkey "$c/ca.key" -CAcreateserial -days 3650 \
    -out "$c/$1.crt" -extfile <(printf '%s\n' "$3")
}
new_ca() {
  newkey "$c/ca.key"
  ossl req -x509 -new -key "$c/ca.key" -subj "/CN=pdrollout-test-ca" -days 3650 -out "$c/ca.crt"
  newkey "$c/sa.key"
  ossl pkey -in "$c/sa.key" -pubout -out "$c/sa.pub"
}

kubeconfig() {  # kubeconfig OUT SERVER CERTNAME: a kubeconfig authenticating with certs/CERTNAME.{crt,key}
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: pdrollout
  cluster: {server: "$2", certificate-authority: "$c/ca.crt"}
users:
- name: $3
  user: {client-certificate: "$c/$3.crt", client-key: "$c/$3.key"}
contexts:
- name: pdrollout
  context: {cluster: pdrollout, user: $3, namespace: default}
current-context: pdrollout
EOF
}
