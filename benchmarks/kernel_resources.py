"""Registers, spills and shared memory of the grouped-FFN kernels as compiled for an H100/H200 (sm_90), on any
machine: Triton compiles for a target without a GPU, and its bundled cuobjdump reads the cubin.

    python benchmarks/kernel_resources.py [KERNEL[=BM,BN,BK,GROUP_M,WARPS,STAGES] ...]

Kernels: up (training forward: saves h), up_infer, down, dh, dx, wgrad; each at its `CONFIGS` entry unless given,
with the flags the model runs them with (no row scale: routing weights are applied at the unpermute).
Integer arguments get the specialisation a real launch at D=3584, I=2048 gives them (1 is a constant, multiples of
16 are marked divisible by 16), which decides vector widths. A spill shows as STACK bytes and local loads/stores.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3ray.kernels import grouped_gemm as gg
from k3ray.kernels.grouped_ffn import CONFIGS

D, INNER, PROGS = 3584, 2048, 132
VALUES = {"D": D, "I": INNER, "sxm": D, "sxk": 1, "swg": D * 2 * INNER, "swk": 2 * INNER, "swn": 1,
          "sym": D, "syk": 1, "spm": D, "spk": 1, "sqm": 2 * INNER, "sqk": 1, "sog": D * 2 * INNER,
          "M1": D, "M2": 2 * INNER}


def desc(rows: int, cols: int) -> str:
    return f"tensordesc<bf16[{rows}, {cols}]>"


def compile_sm90(kernel, sig: dict, const: dict, warps: int, stages: int, values: dict):
    const = dict(const)
    attrs = {}
    for name in list(sig):
        v = values.get(name)
        if v == 1:
            const[name] = 1
        elif sig[name].startswith("*") or (v is not None and v % 16 == 0):
            attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
    sig = {**sig, **{k: "constexpr" for k in const}}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def resources(compiled) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return {"registers": int(regs), "spill_bytes": int(stack), "local_ld_st": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "smem_kb": compiled.metadata.shared / 1024}


ROWTILED = {"tiles_ptr": "*i32", "ends_ptr": "*i32", "MT": "i32"}


def build(name: str, cfg) -> object:
    bm, bn, bk, gm, warps, stages = cfg
    tile = dict(TMA=True, BM=bm, BN=bn, BK=bk, GROUP_M=gm, NUM_PROGS=PROGS, EVEN_K=True, EVEN_N=True, DOT_F32=False)
    if name in ("up", "up_infer"):
        sig = {"x_src": desc(bm, bk), "w1_src": desc(bk, bn), "a_ptr": "*bf16", "h_ptr": "*bf16", **ROWTILED,
               "D": "i32", "I": "i32", "sxm": "i32", "sxk": "i32", "swg": "i32", "swk": "i32", "swn": "i32",
               "beta": "fp32", "beta_lin": "fp32"}
        return compile_sm90(gg.ffn_up_kernel, sig, dict(SAVE_H=name == "up", FAST_ACT=True, **tile), warps, stages,
                            VALUES)
    if name in ("down", "dx"):
        trans = name == "dx"
        k_dim, n_out = (2 * INNER, D) if trans else (INNER, D)
        sig = {"a_src": desc(bm, bk), "b_src": desc(bn, bk) if trans else desc(bk, bn), "c_ptr": "*bf16",
               "scale_ptr": "*bf16", **ROWTILED, "K": "i32", "NOUT": "i32", "sam": "i32", "sak": "i32",
               "sbg": "i32", "sbk": "i32", "sbn": "i32"}
        values = {"K": k_dim, "NOUT": n_out, "sam": k_dim, "sak": 1, "sbg": k_dim * n_out,
                  "sbk": 1 if trans else n_out, "sbn": k_dim if trans else 1}
        return compile_sm90(gg.grouped_mm_kernel, sig, dict(HAS_SCALE=False, TRANS_B=trans, **tile), warps, stages,
                            values)
    if name == "dh":
        sig = {"dy_src": desc(bm, bk), "w2_src": desc(bn, bk), "h_ptr": "*bf16", "scale_ptr": "*fp32",
               "dh_ptr": "*bf16", "ds_ptr": "*fp32", **ROWTILED, "D": "i32", "I": "i32", "sym": "i32",
               "syk": "i32", "swg": "i32", "swk": "i32", "swn": "i32", "beta": "fp32", "beta_lin": "fp32"}
        values = {**VALUES, "swg": INNER * D, "swk": 1, "swn": D}
        return compile_sm90(gg.ffn_dh_kernel, sig, dict(HAS_SCALE=False, FAST_ACT=True, **tile), warps, stages,
                            values)
    if name == "wgrad":
        sig = {"p_ptr": "*bf16", "q_ptr": "*bf16", "out_dst": desc(bm, bn), "ends_ptr": "*i32", "order_ptr": "*i32",
               "M1": "i32", "M2": "i32", "G": "i32", "spm": "i32", "spk": "i32", "sqm": "i32", "sqk": "i32",
               "sog": "i32"}
        const = dict(TMA_OUT=True, BM=bm, BN=bn, BK=bk, GROUP_M=gm, NUM_PROGS=PROGS, DOT_F32=False)
        return compile_sm90(gg.grouped_wgrad_kernel, sig, const, warps, stages, VALUES)
    raise SystemExit(f"unknown kernel {name!r}: up, up_infer, down, dh, dx, wgrad")


CONFIG_OF = {"up": "up_tma", "up_infer": "up_tma", "down": "down_tma", "dh": "dh_tma", "dx": "dx_tma",
             "wgrad": "wgrad"}


def main(args: list[str]) -> None:
    print(f"triton {triton.__version__}, target sm_90")
    print("| kernel | config (BM, BN, BK, GROUP_M, warps, stages) | registers | spill bytes | local ld/st | smem KiB |")
    print("|---|---|---|---|---|---|")
    for arg in args or list(CONFIG_OF):
        name, _, given = arg.partition("=")
        if name not in CONFIG_OF:
            raise SystemExit(f"unknown kernel {name!r}: {', '.join(CONFIG_OF)}")
        cfg = tuple(int(v) for v in given.split(",")) if given else tuple(CONFIGS[CONFIG_OF[name]])
        if len(cfg) != 6:
            raise SystemExit(f"{arg}: a config is six integers BM,BN,BK,GROUP_M,WARPS,STAGES")
        r = resources(build(name, cfg))
        print(f"| {name} | {cfg} | {r['registers']} | {r['spill_bytes']} | {r['local_ld_st']} | {r['smem_kb']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
