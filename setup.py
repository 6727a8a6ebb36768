"""Build of the compiled index core (everything else is in pyproject.toml).

The core is Cython (``kvevents/index/_core.pyx``); pip fetches Cython at build time
(``[build-system] requires``), so installing needs only a C compiler.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("kvevents.index._core", ["kvevents/index/_core.pyx"],
                   extra_compile_args=["-O3"])],
        language_level=3,
    ),
)
