#!/usr/bin/env bash
# Regenerates the Go SDK's gRPC/protobuf stubs from proto/cbserve/v1/*.proto.
#
#   scripts/generate_go_stubs.sh           # rewrite sdk/go/gen/cbserve/v1/ (committed: Go users fetch it as is)
#   scripts/generate_go_stubs.sh --check   # exit 1 (with a diff) if the committed Go stubs are stale
#
# Runs buf (proto/node_modules/.bin/buf, pinned in proto/package.json: `npm ci --prefix proto`) with the
# template proto/buf.gen.go.yaml and two local plugins pinned below. They are installed once into
# sdk/go/.bin (git-ignored) from the Go module proxy; after that the script runs offline. Another
# plugin version stamps different headers into the generated files, so the script refuses one.
set -euo pipefail

PROTOC_GEN_GO_VERSION="v1.36.12"      # google.golang.org/protobuf/cmd/protoc-gen-go
PROTOC_GEN_GO_GRPC_VERSION="v1.6.2"   # google.golang.org/grpc/cmd/protoc-gen-go-grpc

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${ROOT}/sdk/go/.bin"
BUF="${ROOT}/proto/node_modules/.bin/buf"
DEST="${ROOT}/sdk/go/gen"

check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

if [[ ! -x "${BUF}" ]]; then
  echo "error: ${BUF#"${ROOT}"/} not found: run \`npm ci --prefix proto\`" >&2
  exit 2
fi
if ! command -v go >/dev/null; then
  echo "error: go not found (needed once, to install the pinned protoc-gen-go and protoc-gen-go-grpc)" >&2
  exit 2
fi

# Installs plugin $1 from module path $2 at version $3 unless sdk/go/.bin already has that version.
# `--version` prints "protoc-gen-go v1.36.12" / "protoc-gen-go-grpc 1.6.2".
ensure_plugin() {
  local name="$1" pkg="$2" version="$3" have=""
  if [[ -x "${BIN}/${name}" ]]; then
    have="$("${BIN}/${name}" --version 2>/dev/null | awk '{print $2}')"
  fi
  if [[ "v${have#v}" != "${version}" ]]; then
    echo "Installing ${pkg}@${version} into ${BIN#"${ROOT}"/}" >&2
    # pkg@version: installed in module mode with the plugin's own dependencies (sdk/go/go.mod is not used).
    GOBIN="${BIN}" go install "${pkg}@${version}"
    have="$("${BIN}/${name}" --version | awk '{print $2}')"
    if [[ "v${have#v}" != "${version}" ]]; then
      echo "error: ${BIN}/${name} reports version ${have}, expected ${version}" >&2
      exit 2
    fi
  fi
}
mkdir -p "${BIN}"
ensure_plugin protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "${PROTOC_GEN_GO_VERSION}"
ensure_plugin protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "${PROTOC_GEN_GO_GRPC_VERSION}"

WORK="$(mktemp -d)"
trap 'rm -rf "${WORK}"' EXIT

# The template's plugin paths and outputs are relative to the repository root; --output puts
# the whole tree (sdk/go/gen/...) under WORK.
(cd "${ROOT}" && "${BUF}" generate proto --template proto/buf.gen.go.yaml --output "${WORK}")
OUT="${WORK}/sdk/go/gen"
if [[ -z "$(find "${OUT}" -name '*.go' 2>/dev/null)" ]]; then
  echo "error: buf generated no Go files" >&2
  exit 1
fi

if [[ ${check} -eq 1 ]]; then
  if diff -ruN "${DEST}" "${OUT}"; then
    echo "Go stubs are up to date."
  else
    echo "error: the committed Go stubs are stale; run scripts/generate_go_stubs.sh" >&2
    exit 1
  fi
else
  rm -rf "${DEST}"
  cp -R "${OUT}" "${DEST}"
  echo "Wrote $(find "${DEST}" -type f | wc -l) files to ${DEST#"${ROOT}"/}"
fi
