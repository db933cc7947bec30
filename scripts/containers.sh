#!/usr/bin/env bash
# The container check (issue 39), from nothing but Docker: base image, node image, the compose
# network of docker/compose.yaml with the project's S3 server in MinIO's place
# (docker/compose.seaweed.yaml), every site behind its own shaped link, a few versions of the tiny
# model, a trainer and an inference node killed with SIGKILL and brought back by their restart
# policies, one digest everywhere, each site's credentials writing only its own bucket; then
# everything is torn down. Fails (never skips) when Docker cannot be installed or started.
#
#   sudo bash scripts/containers.sh            # .ci/run runs it after the suite
#
# Environment: PN_LINK_RATE (100mbit), PN_LINK_DELAY_MS (40), PN_CHECK_VERSIONS (versions to run
# before the kills, 2), PN_CONTAINERS_CACHE (/var/cache/pulsenet-containers: wheels kept between
# runs), PN_DEBIAN_MIRROR (http://deb.debian.org/debian), PN_KEEP=1 (leave the network up).
# Cached between runs: the base image and the image's layers (Docker's own store) and the wheels.
# Figures it prints are the ones docs/deploy.md quotes.
set -euo pipefail
# All of it in one function: bash reads the whole file before running any of it.
main() {
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
T0=$(date +%s)
say() { printf '[containers %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root (it installs and starts Docker)"

CACHE=${PN_CONTAINERS_CACHE:-/var/cache/pulsenet-containers}
BASE_IMAGE=pulsenet-base:bookworm
IMAGE=pulsenet:cpu
PROJECT=pncheck
export PN_LINK_RATE=${PN_LINK_RATE:-100mbit} PN_LINK_DELAY_MS=${PN_LINK_DELAY_MS:-40}
VERSIONS=${PN_CHECK_VERSIONS:-2}
COMPOSE=(docker-compose -p "$PROJECT" -f docker/compose.yaml -f docker/compose.seaweed.yaml)
START_PERIOD=120  # docker/compose.yaml's healthcheck start_period

# --- Docker: installed and running, or a failure ------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || fail "cannot install ${missing[*]}"
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: /tmp/pulsenet-dockerd.log)"
  nohup dockerd >/tmp/pulsenet-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 /tmp/pulsenet-dockerd.log; fail "dockerd did not start"; }
fi
say "docker $(docker info -f '{{.ServerVersion}}' 2>/dev/null), $(docker-compose version --short)"

# --- the base image: debootstrap, where no registry is reachable (cached in Docker's store) -----
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  say "making $BASE_IMAGE with debootstrap"
  rootfs=$(mktemp -d /tmp/pulsenet-base.XXXXXX)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,iproute2 bookworm \
    "$rootfs" "${PN_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/tmp/pulsenet-debootstrap.log 2>&1 \
    || { tail -20 /tmp/pulsenet-debootstrap.log; fail "debootstrap"; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
fi
say "base image: $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

# --- the build context holds no private keys (.dockerignore), checked by Docker itself ----------
rm -rf docker/extra/certs docker/extra/wheels
created=() made=()
for d in .pulsenet-up .pulsenet-up/keys keys state; do [ -d "$d" ] || { mkdir "$d"; made=("$d" "${made[@]}"); }; done
for f in .pulsenet-up/keys/containers-probe.key keys/containers-probe.key state/containers-probe; do
  [ -e "$f" ] || { echo probe >"$f"; created+=("$f"); }
done
printf 'FROM %s\nCOPY . /ctx\n' "$BASE_IMAGE" | docker build -q -f - -t pulsenet-context-probe . >/dev/null \
  || fail "context probe build"
listing=$(docker run --rm --entrypoint find pulsenet-context-probe /ctx)
docker rmi -f pulsenet-context-probe >/dev/null
for f in "${created[@]}"; do rm -f "$f"; done
for d in "${made[@]}"; do rmdir "$d"; done
for leak in .venv keys state .pulsenet-up docker/.env .git tests; do
  if grep -qx "/ctx/$leak" <<<"$listing"; then fail "build context holds $leak"; fi
done
if grep -q '\.key$' <<<"$listing"; then fail "build context holds a .key file: $(grep '\.key$' <<<"$listing")"; fi
say "build context: $(wc -l <<<"$listing") paths, no .venv, keys/, state/, .pulsenet-up/ or *.key"

# --- what the build takes from this machine: CA certificates and wheels (docker/extra/) ---------
pipconf() { python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*\.$1='\(.*\)'$/\1/p" | head -1; }
mkdir -p docker/extra/certs docker/extra/wheels "$CACHE/wheels"
cert=${PIP_CERT:-$(pipconf cert)}
[ -n "$cert" ] && [ -f "$cert" ] && cp "$cert" docker/extra/certs/pip-cert.crt
links=$(pipconf find-links)
torch_wheel=$(ls "$links"/torch-2.13.0*cp311*x86_64.whl 2>/dev/null | head -1 || true)
[ -n "$torch_wheel" ] && cp -f "$torch_wheel" "$CACHE/wheels/"
grep -v -e '^#' -e '^torch==' docker/constraints.txt >"$CACHE/requirements.txt"
say "wheels of docker/constraints.txt into $CACHE/wheels (pip download; cached)"
python3 -m pip download -q --no-deps --only-binary :all: -d "$CACHE/wheels" -r "$CACHE/requirements.txt" \
  --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
  2>&1 | grep -v -e 'is ignored: it is neither' || true
cp -l "$CACHE"/wheels/*.whl docker/extra/wheels/ 2>/dev/null || cp "$CACHE"/wheels/*.whl docker/extra/wheels/
build_args=(--build-arg "BASE=$BASE_IMAGE")
if [ -n "$torch_wheel" ]; then build_args+=(--build-arg WHEELS_ONLY=1); fi

# --- the node image ------------------------------------------------------------------------------
b0=$(date +%s)
# The dependency stage gets a tag of its own: pruning the untagged images an earlier build left
# (below) then keeps it, the layer cache that makes a rebuild take seconds.
docker build -q -f docker/Dockerfile --target deps -t pulsenet:deps "${build_args[@]}" . >/tmp/pulsenet-build.log 2>&1 \
  && docker build -q -f docker/Dockerfile -t "$IMAGE" "${build_args[@]}" . >>/tmp/pulsenet-build.log 2>&1 \
  || { tail -30 /tmp/pulsenet-build.log; fail "docker build"; }
BUILD_S=$(( $(date +%s) - b0 ))
docker image prune -f >/dev/null
IMAGE_MB=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f", $1/1e6}')
say "image $IMAGE: built in ${BUILD_S} s, ${IMAGE_MB} MB"
# The CUDA image up to the stage that needs its GPU base (pytorch/pytorch cannot be had here).
docker build -q -f docker/Dockerfile.cuda --target wheel --build-arg WHEEL_BASE="$BASE_IMAGE" \
  "${build_args[@]:2}" -t pulsenet:cuda-wheel . >/tmp/pulsenet-build-cuda.log 2>&1 \
  || { tail -30 /tmp/pulsenet-build-cuda.log; fail "docker build -f docker/Dockerfile.cuda --target wheel"; }
docker run --rm --entrypoint sh pulsenet:cuda-wheel -c 'ls /dist/pulsenet-*.whl' >/dev/null || fail "no wheel in the CUDA image's wheel stage"
say "Dockerfile.cuda: its wheel stage builds (the CUDA stage needs pytorch/pytorch: not built here)"

# --- the compose network -------------------------------------------------------------------------
secret() { python3 -c 'import secrets; print(secrets.token_urlsafe(24))'; }
export MINIO_ROOT_PASSWORD=$(secret) PN_SECRET_t0=$(secret) PN_SECRET_t1=$(secret) PN_SECRET_i0=$(secret) PN_SECRET_i1=$(secret)
teardown() {
  local rc=$?
  if [ "${PN_KEEP:-0}" = 1 ]; then say "PN_KEEP=1: network $PROJECT left up"; return; fi
  [ $rc = 0 ] || { for s in trainer-t0 trainer-t1 inference-i0 inference-i1 minio; do
    echo "--- $s"; docker logs --tail 15 "${PROJECT}_${s}_1" 2>&1 | cut -c1-400; done; } || true
  "${COMPOSE[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
  say "torn down"
}
trap teardown EXIT
"${COMPOSE[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
NODES=(trainer-t0 trainer-t1 inference-i0 inference-i1)
declare -gA PORT=([trainer-t0]=8100 [trainer-t1]=8101 [inference-i0]=8110 [inference-i1]=8111)
up0=$(date +%s.%N)
"${COMPOSE[@]}" up -d --no-build >/tmp/pulsenet-compose-up.log 2>&1 || { cat /tmp/pulsenet-compose-up.log; fail "compose up"; }
say "compose up (links: $PN_LINK_RATE, $PN_LINK_DELAY_MS ms each way)"

since() { python3 -c "import sys,time; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$1"; }
status() {  # node -> "version digest health" or "- - down"
  curl -s -m 5 "http://127.0.0.1:${PORT[$1]}/status" 2>/dev/null | python3 -c '
import json, sys
try: d = json.load(sys.stdin)
except ValueError: print("- - down"); sys.exit()
print(d["version"] if d["version"] is not None else "-", d["digest"] or "-", d["health"]["status"])' 2>/dev/null || echo "- - down"
}
# wait_same V: every node serves version >= V and all serve one version with one digest
wait_same() {
  local want=$1 limit=$2 t=$(date +%s) line
  while :; do
    line=$(for n in "${NODES[@]}"; do status "$n"; done)
    if ! grep -q '^-' <<<"$line"; then
      local vmin
      vmin=$(awk '{print $1}' <<<"$line" | sort -n | head -1)
      if [ "$vmin" -ge "$want" ] && [ "$(awk '{print $1, $2}' <<<"$line" | sort -u | wc -l)" = 1 ]; then
        SAME=$(head -1 <<<"$line"); return 0
      fi
    fi
    [ $(( $(date +%s) - t )) -lt "$limit" ] || { echo "$line"; return 1; }
    sleep 1
  done
}

# Trainers healthy within the health check's start_period, on this host (defect 1 of issue 39).
declare -gA HEALTHY=()
while [ ${#HEALTHY[@]} -lt 2 ]; do
  for n in trainer-t0 trainer-t1; do
    [ -z "${HEALTHY[$n]:-}" ] || continue
    c="${PROJECT}_${n}_1"
    read -r health started <<<"$(docker inspect -f '{{.State.Health.Status}} {{.State.StartedAt}}' "$c")"
    age=$(python3 -c "
import sys; from datetime import datetime
print(int((datetime.utcnow() - datetime.fromisoformat(sys.argv[1][:26].rstrip('Z'))).total_seconds()))" "$started")
    if [ "$health" = healthy ]; then
      HEALTHY[$n]=$age
      [ "$age" -le "$START_PERIOD" ] || fail "$n took ${age} s to be healthy (start_period ${START_PERIOD} s)"
      say "$n healthy ${age} s after its start (start_period ${START_PERIOD} s; $(nproc) cores)"
    elif [ "$age" -gt "$START_PERIOD" ]; then
      fail "$n not healthy ${age} s after its start (start_period ${START_PERIOD} s)"
    fi
  done
  sleep 1
done

wait_same 0 240 || fail "no common first version"
FIRST_S=$(since "$up0")
say "first version everywhere ${FIRST_S} s after compose up: $SAME"
v_t=$(date +%s.%N); v_from=$(awk '{print $1}' <<<"$SAME")
wait_same "$VERSIONS" 420 || fail "not at v$VERSIONS with one digest"
v_to=$(awk '{print $1}' <<<"$SAME")
VPM=$(python3 -c "import sys; print(f'{(int(sys.argv[2])-int(sys.argv[1]))*60/float(sys.argv[3]):.2f}')" "$v_from" "$v_to" "$(since "$v_t")")
say "v$v_to everywhere, one digest ($SAME); ${VPM} versions/min through the links"

# Rollouts: the nodes make batches to the trainers' signed demand (G, prompts: the ids in
# PULSENET_POLICY, defect 2) and the trainers train on them, refusing none of these honest nodes'.
for n in trainer-t0 trainer-t1; do
  read -r consumed rejected <<<"$(curl -s -m 5 "http://127.0.0.1:${PORT[$n]}/status" | python3 -c '
import json, sys
r = json.load(sys.stdin)["rollouts"]
print(r.get("consumed", 0), r.get("rejected", 0))' 2>/dev/null || echo "0 ?")"
  [ "${consumed:-0}" -gt 0 ] 2>/dev/null || fail "$n took no rollout rows by v$v_to"
  [ "$rejected" = 0 ] || fail "$n refused $rejected batches of honest nodes"
  say "$n: $consumed rollout rows taken, 0 batches refused"
done

# Sites: a node reaches the store only through its link; its credentials write only its bucket.
store_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' "${PROJECT}_minio_1" | awk '{print $1}')
for n in "${NODES[@]}"; do
  site=${n#*-}
  docker exec "${PROJECT}_${n}_1" python -c "
import socket, sys
for target in (('$store_ip', 9000), ('minio', 9000)):
    try:
        socket.create_connection(target, timeout=3)
    except OSError:
        continue
    sys.exit(f'$n reaches the store at {target} without its link')
" || fail "$n is not behind its link"
  docker exec -i "${PROJECT}_${n}_1" python - "$site" <<'EOF' || fail "$n's credentials"
import os, sys
import boto3, botocore.exceptions as bex
site = sys.argv[1]
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
for b in ("pulsenet-t0", "pulsenet-t1", "pulsenet-i0", "pulsenet-i1", "pulsenet-loco"):
    own = b == f"pulsenet-{site}" or (b == "pulsenet-loco" and site.startswith("t"))
    try:
        s3.put_object(Bucket=b, Key=f"containers-check/{site}", Body=b"x")
        s3.delete_object(Bucket=b, Key=f"containers-check/{site}")
        wrote = True
    except bex.ClientError as e:
        if e.response["Error"]["Code"] != "AccessDenied":
            raise
        wrote = False
    s3.list_objects_v2(Bucket=b, MaxKeys=1)  # every site reads every bucket
    assert wrote == own, f"site {site} {'wrote' if wrote else 'could not write'} {b}"
EOF
done
say "each node reaches the store only through its link; each site's credentials write only its own bucket"

# The link as the nodes see it: round trip and rate of one site's store calls.
docker exec -i "${PROJECT}_trainer-t0_1" python - <<'EOF' >/tmp/pulsenet-link.txt || fail "link measurement"
import os, time
import boto3
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
s3.head_bucket(Bucket="pulsenet-t0")
rtt = []
for _ in range(5):
    t = time.perf_counter(); s3.head_bucket(Bucket="pulsenet-t0"); rtt.append(time.perf_counter() - t)
body = os.urandom(24 << 20)
t = time.perf_counter(); s3.put_object(Bucket="pulsenet-t0", Key="containers-check/rate", Body=body); up = time.perf_counter() - t
t = time.perf_counter(); s3.get_object(Bucket="pulsenet-t0", Key="containers-check/rate")["Body"].read(); down = time.perf_counter() - t
s3.delete_object(Bucket="pulsenet-t0", Key="containers-check/rate")
print(f"{min(rtt)*1000:.0f} {len(body)*8/up/1e6:.0f} {len(body)*8/down/1e6:.0f}")
EOF
read -r RTT UP DOWN </tmp/pulsenet-link.txt
say "link t0: round trip ${RTT} ms, up ${UP} Mbit/s, down ${DOWN} Mbit/s (set: $PN_LINK_RATE, $PN_LINK_DELAY_MS ms each way)"
if [ "$PN_LINK_DELAY_MS" -gt 0 ]; then
  [ "$RTT" -ge $(( 2 * PN_LINK_DELAY_MS )) ] || fail "round trip ${RTT} ms under twice the link's delay"
fi
if [ "$PN_LINK_RATE" = 100mbit ]; then
  [ "$UP" -le 110 ] && [ "$DOWN" -le 110 ] || fail "the link is not limited to 100 Mbit/s"
fi

# Kills: SIGKILL to a node's process (as the kernel's OOM killer would); its restart policy brings
# it back and it catches up to the others' version and digest.
for n in trainer-t0 inference-i0; do
  c="${PROJECT}_${n}_1"
  restarts=$(docker inspect -f '{{.RestartCount}}' "$c")
  pid=$(docker inspect -f '{{.State.Pid}}' "$c")
  k0=$(date +%s.%N)
  kill -9 "$pid"
  for _ in $(seq 300); do
    [ "$(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$c")" = "$((restarts + 1)) true" ] && break
    sleep 0.1
  done
  [ "$(docker inspect -f '{{.RestartCount}}' "$c")" = $((restarts + 1)) ] || fail "$n was not restarted"
  back=$(since "$k0")
  target=$(( $(awk '{print $1}' <<<"$SAME") + 1 ))
  wait_same "$target" 420 || fail "$n did not catch up to v$target"
  say "$n: kill -9, restarted by its policy in ${back} s, caught up with v$(awk '{print $1}' <<<"$SAME") and one digest after $(since "$k0") s"
done

say "PASS: build ${BUILD_S} s, image ${IMAGE_MB} MB, first version ${FIRST_S} s, ${VPM} versions/min, link rtt ${RTT} ms, total $(( $(date +%s) - T0 )) s"
}
main "$@"
