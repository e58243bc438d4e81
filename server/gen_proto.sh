#!/usr/bin/env sh
# Regenerate server/proto/sarathi/v1/generation_pb2{,_grpc}.py{,i} from generation.proto.
set -e
cd "$(dirname "$0")/.."
exec python -m server.gen_proto "$@"
