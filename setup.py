"""The one compiled piece of kubetron, optional: pyproject.toml holds everything else.

kubetron.checkpoint._hostcopy (trainer/kubetron/checkpoint/_hostcopy.c) copies checkpoint snapshots into host memory with
non-temporal stores. `optional=True`: without a C compiler the install goes on, and the trainer falls
back to ctypes.memmove (same bytes, about half the speed). The limited API (abi3): one build serves
every CPython >= 3.11.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kubetron.checkpoint._hostcopy",
            ["trainer/kubetron/checkpoint/_hostcopy.c"],
            optional=True,
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            extra_compile_args=["-O2"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
