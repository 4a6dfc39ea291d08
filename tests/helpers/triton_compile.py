"""Compile the Triton attention kernels for NVIDIA GPUs on a machine without one: Triton's frontend, its MLIR
passes, PTX and ptxas (shipped in the Triton wheel) all run on the CPU. Catches what the interpreter cannot: code
the compiler refuses, and a version of Triton that does not accept it (run with Triton 3.6, the GPU image's, too).

Run as ``python -m tests.helpers.triton_compile [--all]`` in a process where TRITON_INTERPRET is unset (interpreted
kernels cannot be compiled); prints one line per variant and exits non-zero on the first failure. Without
``--all``: sm_90, float32 and bfloat16, three shapes (~6 s, the test's); with it: sm_80 too, float16, five shapes.
"""

from __future__ import annotations

import os
import sys

TARGETS = ((90, "H100 / H200"), (80, "A100"))
_DTYPES = {"fp32": 1, "bf16": 0, "fp16": 0}  # the kernel's PRECISION on a GPU


def _signature(kernel, pointer_dtype: str, int_pointers: dict[str, str]) -> dict[str, str]:
    """Every argument's type by its name: ``*_ptr`` pointers (``int_pointers`` for the integer ones), ``scale`` a
    float, the constexprs marked so, the rest 32-bit ints."""
    sig = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = int_pointers.get(name, f"*{pointer_dtype}")
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def main(everything: bool = False) -> int:
    assert os.environ.get("TRITON_INTERPRET") != "1", "compiling needs the kernels uninterpreted"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from conveyor.kernels import triton_attention as kernels

    lens = {"block_table_ptr": "*i64", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32"}
    variants = []
    shapes = ((64, 8, True, 0), (128, 4, False, 4096), (96, 3, False, 0))  # (head_dim, group, decode_only, window)
    if everything:
        shapes += ((64, 8, False, 0), (128, 1, True, 0))
    for dtype in _DTYPES if everything else ("fp32", "bf16"):
        for head_dim, group, decode_only, window in shapes:
            shape = kernels.LaunchShape(group, decode_only)
            variants.append((f"attention {dtype} d={head_dim} group={group} "
                             f"{'decode' if decode_only else 'mixed'} window={window}",
                             kernels._paged_attention_kernel, _signature(kernels._paged_attention_kernel, dtype, lens),
                             dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
                                  BLOCK_SIZE=16, BLOCK_Q=shape.block_q, BLOCK_M=shape.block_m,
                                  TILE=kernels.LaunchShape.TILE, WINDOW=window, PRECISION=_DTYPES[dtype])))
        variants.append((f"write_kv {dtype}", kernels._write_kv_kernel,
                         _signature(kernels._write_kv_kernel, dtype, {"slot_ptr": "*i64"}),
                         dict(HEAD_DIM=128, HEAD_DIM_P2=128, BLOCK_SIZE=16)))
    for arch, gpu in TARGETS if everything else TARGETS[:1]:
        for name, kernel, sig, consts in variants:
            try:
                compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", arch, 32))
            except Exception as exc:  # noqa: BLE001 - report which variant and why, then fail
                print(f"FAIL sm_{arch} ({gpu}) {name}: {type(exc).__name__}: {exc}", flush=True)
                return 1
            assert compiled.asm.get("cubin"), name
            print(f"ok sm_{arch} {name}: shared memory {compiled.metadata.shared} B (Triton {triton.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main("--all" in sys.argv[1:]))
