#!/usr/bin/env bash
# Regenerate the scheduler's gRPC modules from scheduler/service/proto/scheduler.proto.
# The generated files are checked in (so installs need no code generation); run this after
# editing the .proto and commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
"$python" -m grpc_tools.protoc \
  -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  scheduler/service/proto/scheduler.proto
echo "regenerated scheduler/service/proto/scheduler_pb2{,_grpc}.py"
