#!/usr/bin/env bash
# Fill the git-ignored folder .whl/ with every wheel needed to `import deepspeed`
# and use `deepspeed.moe.layer.MoE` on an offline GPU machine
# (Python 3.12, torch/triton/numpy already installed there, pydantic maybe not).
#
# Run HERE (network + pip):    bash benchmarks/carry_deepspeed.sh
# Install on the GPU machine:  python3 -m pip install -q --no-index --no-deps --no-compile \
#                                  --upgrade --target /tmp/dsw .whl/*.whl
#                              export PYTHONPATH=/tmp/dsw:$PYTHONPATH DS_BUILD_OPS=0
#                              python3 benchmarks/moe_deepspeed.py
#
# DeepSpeed only ships an sdist; it is built here into a pure-python wheel with
# no compiled ops (DS_BUILD_OPS=0): the MoE layer uses plain torch.  Everything
# else is a binary wheel for cp312 / manylinux x86_64, downloaded with --no-deps
# and pinned (the pins below match deepspeed's Requires-Dist, torch and numpy
# excluded since the GPU machine has them).
#
# Env overrides: PY (build interpreter, needs torch + setuptools; default python3),
#                DS_VERSION, WHL_DIR, KEEP_BUILD=1 (keep the temp build dir).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL_DIR="${WHL_DIR:-$REPO/.whl}"
PY="${PY:-python3}"
DS_VERSION="${DS_VERSION:-0.19.8}"

# deepspeed 0.19.8 Requires-Dist (besides torch, numpy): einops hjson msgpack ninja
# packaging>=20 psutil py-cpuinfo pydantic>=2 tqdm; pydantic 2.14.4 pins
# pydantic-core==2.50.5 and needs annotated-types, typing-extensions, typing-inspection.
# nvidia-ml-py gives pynvml, which deepspeed's CUDA accelerator imports if present.
BINARY_PINS=(
    hjson==3.1.0
    py-cpuinfo==9.0.0
    ninja==1.13.2
    msgpack==1.2.4
    nvidia-ml-py==13.615.71
    einops==0.8.2
    psutil==7.2.2
    packaging==26.4
    tqdm==4.70.1
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
)

mkdir -p "$WHL_DIR"
# pip, quieter: drop the "Location 'file://...' is ignored" noise of local pip configs.
pipq() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
BUILD="$(mktemp -d)"
cleanup() { [ "${KEEP_BUILD:-0}" = 1 ] || rm -rf "$BUILD"; }
trap cleanup EXIT

# ---- 1. deepspeed: sdist -> pure-python wheel, no ops compiled -------------
if ls "$WHL_DIR"/deepspeed-"$DS_VERSION"-py3-none-any.whl >/dev/null 2>&1; then
    echo "[carry] deepspeed $DS_VERSION wheel already present"
else
    rm -f "$WHL_DIR"/deepspeed-*.whl
    pipq download -q --no-deps --no-binary=:all: "deepspeed==$DS_VERSION" -d "$BUILD/sdist"
    # DS_BUILD_OPS=0: no C++/CUDA op is pre-compiled (ext_modules stays empty, so the
    # wheel is py3-none-any).  DS_ACCELERATOR=cuda only makes the recorded
    # accelerator_name 'cuda' (deepspeed picks the accelerator at run time anyway);
    # fall back to auto-detection if the cuda op builders refuse this CPU machine.
    build_ds() {
        env DS_BUILD_OPS=0 "$@" "$PY" -m pip wheel -q --no-deps --no-build-isolation \
            "$BUILD/sdist/deepspeed-$DS_VERSION.tar.gz" -w "$BUILD/wheel" >"$BUILD/build.log" 2>&1
    }
    if ! build_ds DS_ACCELERATOR=cuda; then
        echo "[carry] build with DS_ACCELERATOR=cuda failed, retrying with auto-detected accelerator"
        tail -5 "$BUILD/build.log"
        build_ds || { cat "$BUILD/build.log"; exit 1; }
    fi
    built=("$BUILD"/wheel/deepspeed-*.whl)
    case "$(basename "${built[0]}")" in
        *-py3-none-any.whl) ;;
        *) echo "[carry] unexpected deepspeed wheel tag: ${built[0]}"; exit 1 ;;
    esac
    # The sdist's build.txt may append a suffix to the version; normalise the file name
    # so the check above finds it next time (pip reads the version from METADATA).
    cp "${built[0]}" "$WHL_DIR/"
    if [ ! -e "$WHL_DIR/deepspeed-$DS_VERSION-py3-none-any.whl" ]; then
        mv "$WHL_DIR/$(basename "${built[0]}")" "$WHL_DIR/deepspeed-$DS_VERSION-py3-none-any.whl"
    fi
fi

# ---- 2. binary dependencies for cp312 manylinux x86_64 ------------------------
for pin in "${BINARY_PINS[@]}"; do
    pipq download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d "$WHL_DIR" "$pin"
done

# ---- 3. check: one wheel per project, tags usable by cp312 x86_64, size ------
"$PY" - "$WHL_DIR" "${BINARY_PINS[@]}" "deepspeed==$DS_VERSION" <<'EOF'
import os, re, sys
whl_dir, pins = sys.argv[1], sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
files = sorted(f for f in os.listdir(whl_dir) if f.endswith(".whl"))
by_name = {}
for f in files:
    parts = f[:-4].split("-")
    name, ver, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    by_name.setdefault(norm(name), []).append((ver, py, abi, plat, f))
bad = []
for pin in pins:
    name, ver = pin.split("==")
    got = by_name.get(norm(name), [])
    if [g[0] for g in got] != [ver]:
        bad.append(f"{pin}: found {[g[4] for g in got]}")
        continue
    _, py, abi, plat, f = got[0]
    ok_py = any(t == "cp312" or t.startswith("py3")
                or (abi == "abi3" and t.startswith("cp3") and int(t[3:]) <= 12)
                for t in py.split("."))
    ok_plat = plat == "any" or ("x86_64" in plat and "linux" in plat)
    ok_abi = abi in ("none", "abi3", "cp312")
    if not (ok_py and ok_plat and ok_abi):
        bad.append(f"{f}: tags {py}-{abi}-{plat} not usable on cp312 linux x86_64")
extra = set(by_name) - {norm(p.split("==")[0]) for p in pins}
total = sum(os.path.getsize(os.path.join(whl_dir, f)) for f in files)
for f in files:
    print(f"  {os.path.getsize(os.path.join(whl_dir, f)) / 1e6:7.2f} MB  {f}")
print(f"[carry] {len(files)} wheels, {total / 1e6:.2f} MB in {whl_dir}")
if extra:
    print(f"[carry] note: other wheels in {whl_dir}: {sorted(extra)}")
if bad:
    sys.exit("[carry] FAILED:\n  " + "\n  ".join(bad))
EOF
