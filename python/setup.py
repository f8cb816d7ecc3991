"""pip install ./python (from the repository root): the cubuf package.

Builds the extension cubuf._cubuf from python/src/*.c and libcubuf's own
sources, compiled in (the list is CUBUF_SOURCES of the top-level
CMakeLists.txt, the version its project() line), so the installed package
needs no libcubuf.so. Needs a C11 compiler, Python's development files and
the CUDA headers (cuda.h under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda);
no driver or GPU. Offline: pip install --no-build-isolation ./python
"""
import os
import re
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cmake_text():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return f.read()


def library_sources(text):
    m = re.search(r"set\(CUBUF_SOURCES\s+([^)]*)\)", text)
    if not m:
        sys.exit("setup.py: CUBUF_SOURCES not found in CMakeLists.txt")
    return [os.path.join(ROOT, s) for s in m.group(1).split()]


def version(text):
    m = re.search(r"project\(cubuf VERSION (\d+)\.(\d+)\.(\d+)", text)
    if not m:
        sys.exit("setup.py: project(cubuf VERSION ...) not found in CMakeLists.txt")
    return m.groups()


def cuda_include():
    for d in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if d and os.path.exists(os.path.join(d, "include", "cuda.h")):
            return os.path.join(d, "include")
    sys.exit("setup.py: cuda.h not found (set CUDA_HOME to the CUDA toolkit)")


class BuildExt(build_ext):
    """Writes <cubuf/version.h> (as CMake does from cmake/version.h.in) into the build tree first."""

    def build_extensions(self):
        major, minor, patch = version(cmake_text())
        gen = os.path.join(os.path.abspath(self.build_temp), "generated")
        os.makedirs(os.path.join(gen, "cubuf"), exist_ok=True)
        with open(os.path.join(ROOT, "cmake", "version.h.in")) as f:
            text = f.read()
        for k, v in (("MAJOR", major), ("MINOR", minor), ("PATCH", patch)):
            text = text.replace("@PROJECT_VERSION_%s@" % k, v)
        with open(os.path.join(gen, "cubuf", "version.h"), "w") as f:
            f.write(text)
        for ext in self.extensions:
            ext.include_dirs.insert(0, gen)
        super().build_extensions()


text = cmake_text()
sources = sorted(os.path.join(HERE, "src", f) for f in os.listdir(os.path.join(HERE, "src")) if f.endswith(".c"))
ext = Extension(
    "cubuf._cubuf",
    sources=sources + library_sources(text),
    include_dirs=[os.path.join(ROOT, "include"), os.path.join(ROOT, "src"), cuda_include()],
    define_macros=[("_GNU_SOURCE", None), ("CUBUF_BUILDING", None)],
    extra_compile_args=["-std=c11", "-fvisibility=hidden"],
    extra_link_args=["-Wl,--version-script=" + os.path.join(HERE, "_cubuf.map")],
    libraries=["dl", "pthread"],
)

setup(
    name="cubuf",
    version=".".join(version(text)),
    description="CUDA memory (cuda.core's Buffer and pyarrow.cuda's Context) over libcubuf",
    packages=["cubuf"],
    package_dir={"cubuf": os.path.relpath(os.path.join(HERE, "cubuf"))},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.10",
    zip_safe=False,
)
