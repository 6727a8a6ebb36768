"""Build of the compiled parts (everything else is in pyproject.toml).

Both are Cython: the index core (``kvevents/index/_core.pyx``) and the ZeroMQ message
drain of the ingest loop (``kvevents/ingest/_zmqrecv.pyx``, which links nothing: it
takes libzmq's functions from pyzmq's copy at run time). pip fetches Cython at build
time (``[build-system] requires``), so installing needs only a C compiler.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("kvevents.index._core", ["kvevents/index/_core.pyx"],
                   extra_compile_args=["-O3"]),
         Extension("kvevents.ingest._zmqrecv", ["kvevents/ingest/_zmqrecv.pyx"],
                   extra_compile_args=["-O2"])],
        language_level=3,
    ),
)
