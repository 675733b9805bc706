#!/usr/bin/env bash
# Build shadow's container image with podman, from a Debian base made here (no registry image).
#
#   deploy/image/build.sh                 # base (cached) + image -> localhost/shadow:<version>
#   deploy/image/build.sh --print-tag     # the image reference it builds, nothing else
#
# 1. The base: Debian bookworm (with its updates and security suites) with python3.11, venv,
#    ca-certificates and libstdc++6, made by mmdebstrap into a rootfs tarball and imported as
#    localhost/shadow-base:bookworm-<key>. <key> hashes the recipe below, so a changed recipe makes a
#    new base and an unchanged one is reused: from podman's storage, else from the cached tarball
#    in $SHADOW_IMAGE_CACHE. --refresh-base rebuilds it anyway (to take Debian's newer packages).
# 2. The image: deploy/image/Containerfile on the repository root (filtered by
#    deploy/image/containerignore); pip fetches the dependencies and setuptools from the package
#    index, so it needs the network. Layers are cached: a code change rebuilds only the wheel.
#
# Environment: SHADOW_IMAGE_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/shadow-image),
# SHADOW_IMAGE_CA (the CA bundle pip uses in the build, for an index behind an intercepting proxy;
# default $PIP_CERT, else the host's /etc/ssl/certs/ca-certificates.crt; "none": the image's own
# bundle), PIP_INDEX_URL (a mirror), SHADOW_IMAGE_ISOLATION (how RUN steps are isolated:
# chroot, the default, needs no OCI runtime and works as root or rootless; or oci),
# SHADOW_IMAGE_EXTRAS (extras installed with shadow, default otlp).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --tag REF        image reference to build (default localhost/shadow:<version from pyproject.toml>)
  --refresh-base   rebuild the base rootfs even if a cached one exists
  --no-cache       rebuild every image layer (passed to podman build)
  --print-tag      print the image reference and exit
  -h, --help       this text
EOF
}

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -n1)"
[ -n "$version" ] || { echo "build.sh: no version in $root/pyproject.toml" >&2; exit 1; }
tag="localhost/shadow:$version"
refresh=0
no_cache=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) [ $# -ge 2 ] || { echo "build.sh: --tag needs a value" >&2; exit 2; }; tag="$2"; shift 2 ;;
    --refresh-base) refresh=1; shift ;;
    --no-cache) no_cache=(--no-cache); shift ;;
    --print-tag) echo "$tag"; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

need() {
  command -v "$1" >/dev/null 2>&1 || {
    echo "build.sh: $1 is missing (Debian: apt-get install -y $2)" >&2; exit 1; }
}
need podman podman
secs() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(secs)" 'BEGIN { printf "%.1f", b - a }'; }

# --- 1. the base ------------------------------------------------------------------------------
suite=bookworm
mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security
recipe=(
  --variant=essential
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --include=python3,python3-venv,ca-certificates,libstdc++6
  --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright'
  --dpkgopt='path-exclude=/usr/share/man/*'
  --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-exclude=/usr/share/info/*'
  "$suite"
  -
  "deb $mirror $suite main"
  "deb $mirror $suite-updates main"
  "deb $security $suite-security main"
)
key="$(printf '%s\n' "${recipe[@]}" | sha256sum | cut -c1-12)"
base="localhost/shadow-base:$suite-$key"
cache="${SHADOW_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shadow-image}"
tarball="$cache/base-$suite-$key.tar"

if [ "$refresh" = 1 ] || ! podman image exists "$base"; then
  if [ "$refresh" = 1 ] || [ ! -s "$tarball" ]; then
    need mmdebstrap mmdebstrap
    mkdir -p "$cache"
    echo "build.sh: making the base rootfs with mmdebstrap ($suite, key $key) ..." >&2
    t0="$(secs)"
    partial="$tarball.partial.$$"
    trap 'rm -f "$partial"' EXIT
    # "-" as the target: the tarball goes to stdout, written under a temporary name, then moved.
    mmdebstrap "${recipe[@]}" > "$partial"
    mv "$partial" "$tarball"
    trap - EXIT
    echo "build.sh: base rootfs $tarball ($(du -h "$tarball" | cut -f1)) in $(took "$t0") s" >&2
  fi
  t0="$(secs)"
  podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/sh"]' "$tarball" "$base" >/dev/null
  echo "build.sh: imported $base in $(took "$t0") s" >&2
else
  echo "build.sh: base $base is in podman's storage (cached)" >&2
fi

# --- 2. the image -----------------------------------------------------------------------------
ca="${SHADOW_IMAGE_CA:-${PIP_CERT:-}}"
if [ -z "$ca" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  ca=/etc/ssl/certs/ca-certificates.crt  # pip in the build trusts what this host trusts
fi
[ "$ca" != none ] || ca=
args=(
  --file "$here/Containerfile"
  --ignorefile "$here/containerignore"
  --isolation "${SHADOW_IMAGE_ISOLATION:-chroot}"
  --network host
  --build-arg "BASE=$base"
  --build-arg "VERSION=$version"
  --build-arg "EXTRAS=${SHADOW_IMAGE_EXTRAS-otlp}"
  --label "org.opencontainers.image.base.name=$base"
  --volume "$cache/pip:/root/.cache/pip"
  --tag "$tag"
)
mkdir -p "$cache/pip"
if [ -n "$ca" ]; then
  [ -f "$ca" ] || { echo "build.sh: CA bundle $ca is not a file" >&2; exit 1; }
  args+=(--volume "$ca:/run/shadow-build/ca.pem:ro" --build-arg PIP_CERT=/run/shadow-build/ca.pem)
fi
[ -z "${PIP_INDEX_URL:-}" ] || args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")

echo "build.sh: building $tag on $base ..." >&2
t0="$(secs)"
podman build "${no_cache[@]}" "${args[@]}" "$root" >&2
size="$(podman image inspect --format '{{.Size}}' "$tag")"
echo "build.sh: built $tag ($(awk -v s="$size" 'BEGIN { printf "%.0f MB", s / 1e6 }')) in $(took "$t0") s" >&2
echo "$tag"
