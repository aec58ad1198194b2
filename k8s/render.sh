#!/usr/bin/env bash
# Renders one overlay to stdout: k8s/render.sh cpu|gpu|tp|gateway
# Installs the pinned kustomize into k8s/.bin from the Go module proxy on first use (needs Go >= 1.22).
set -euo pipefail
KUSTOMIZE_VERSION=v5.8.1
here="$(cd "$(dirname "$0")" && pwd)"
overlay="${1:?usage: k8s/render.sh cpu|gpu|tp|gateway}"
[[ -d "$here/overlays/$overlay" ]] || { echo "no overlay k8s/overlays/$overlay" >&2; exit 2; }
bin="$here/.bin/kustomize"
if [[ ! -x "$bin" ]] || [[ "$("$bin" version 2>/dev/null)" != "$KUSTOMIZE_VERSION" ]]; then
  echo "installing kustomize $KUSTOMIZE_VERSION into $here/.bin" >&2
  GOBIN="$here/.bin" GOFLAGS=-mod=mod go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION" >&2
fi
exec "$bin" build "$here/overlays/$overlay"
