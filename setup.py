"""Optional compiled kernels (everything else is declared in pyproject.toml).

The dump scanner and the dump comparison each have a small C kernel that makes one pass over a
block where numpy needs one pass per operation (agent/kernels/, docs/kernels.md). Both are
optional: when no C compiler is found the build still succeeds (``optional=True``) and the agent
uses its numpy implementation, which gives the same statistics. ``PRECISION_AGENT_KERNELS=numpy``
selects the numpy path at run time even when the kernels are built.

Each kernel is one C source, compiled once per variant with its vector width as a parameter
(agent/kernels/simd.h): on x86-64 with GCC or clang, for x86-64-v4 (AVX-512, -DVW=64) and
x86-64-v3 (AVX2, -DVW=32) besides the baseline the module itself is built for (SSE2, -DVW=16),
the module picking at import what the CPU runs; elsewhere (aarch64: NEON) the baseline alone.
"""

import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=off: GCC already fuses no multiply-adds under -std=c11, clang does unless told,
# and the kernels' results must not depend on the compiler or the variant
_ARGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-ffp-contract=off"] if sys.platform != "win32" else []
_X86 = sys.platform != "win32" and platform.machine().lower() in ("x86_64", "amd64")
# (symbol suffix, vector width in bytes, flags) of the variants besides the module's baseline
VARIANTS = [("v4", 64, ["-march=x86-64-v4"]), ("v3", 32, ["-march=x86-64-v3"])] if _X86 else []


class VariantBuild(build_ext):
    """Compiles each kernel's source once more per variant and links those objects in."""

    def build_extension(self, ext):
        objs = []
        for suffix, width, flags in VARIANTS if getattr(ext, "variants", False) else []:
            objs += self.compiler.compile(
                ext.sources, output_dir=f"{self.build_temp}/{suffix}", depends=ext.depends,
                macros=[("VW", str(width)), ("KERNEL_VARIANT", suffix)],
                extra_postargs=ext.extra_compile_args + flags)
        ext.extra_objects = list(ext.extra_objects or []) + objs
        super().build_extension(ext)


def _kernel(name: str) -> Extension:
    ext = Extension(f"precision_agent.kernels._{name}", [f"agent/kernels/{name}.c"],
                    depends=["agent/kernels/simd.h"], extra_compile_args=_ARGS, optional=True,
                    define_macros=[("KERNEL_MODULE", "1")] + ([("KERNEL_X86_VARIANTS", "1")] if VARIANTS else []))
    ext.variants = True
    return ext


setup(ext_modules=[_kernel("scan"), _kernel("compare")], cmdclass={"build_ext": VariantBuild})
