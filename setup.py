"""Optional compiled kernels (everything else is declared in pyproject.toml).

The dump scanner and the dump comparison each have a small C kernel that makes one pass over a
block where numpy needs one pass per operation. Both are optional: when no C compiler is found
the build still succeeds (``optional=True``) and the agent uses its numpy implementation, which
gives the same statistics (see docs/kernels.md). ``PRECISION_AGENT_KERNELS=numpy`` selects the
numpy path at run time even when the kernels are built.
"""

import sys

from setuptools import Extension, setup

# -ffp-contract=off: GCC already fuses no multiply-adds under -std=c11, clang does unless told,
# and the kernels' results must not depend on the compiler or the CPU's clone
_ARGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-ffp-contract=off"] if sys.platform != "win32" else []

setup(ext_modules=[
    Extension("precision_agent.dumps._scanc", ["agent/dumps/_scanc.c"],
              extra_compile_args=_ARGS, optional=True),
    Extension("precision_agent.compare._comparec",
              ["agent/compare/_comparec.c", "agent/compare/_comparec_loops.c",
               "agent/compare/_comparec512.c", "agent/compare/_comparec256.c"],
              depends=["agent/compare/_comparec.h"], extra_compile_args=_ARGS, optional=True),
])
