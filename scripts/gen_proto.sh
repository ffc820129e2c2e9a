#!/usr/bin/env bash
# Regenerate the scheduler's gRPC modules from swarm/scheduler_api/scheduler.proto.
# The generated files are checked in (so installs need no code generation); run this after
# editing the .proto and commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
"$python" -m grpc_tools.protoc \
  -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  swarm/scheduler_api/scheduler.proto
# the package installs as llm_swarm (setup.cfg's package_dir): the generated import must say so
sed -i 's/^from swarm\.scheduler_api import/from llm_swarm.swarm.scheduler_api import/' \
  swarm/scheduler_api/scheduler_pb2_grpc.py
echo "regenerated swarm/scheduler_api/scheduler_pb2{,_grpc}.py"
