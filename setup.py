"""Build of the compiled parts (everything else is in pyproject.toml).

All are Cython: the index core (``kvevents/index/_core.pyx``, with its wire reader),
the ZeroMQ message drain of the ingest loop (``kvevents/ingest/_zmqrecv.pyx``, which
links nothing: it takes libzmq's functions from pyzmq's copy at run time) and the
reader of common ``/v1/lookup`` bodies (``kvevents/api/_fastbody.pyx``) and the relay of
streamed answers' bodies (``kvevents/gateway/_pump.pyx``) and the word split of new
prompt text (``kvevents/text/_split.pyx``). pip fetches
Cython at build time (``[build-system] requires``), so installing needs only a C
compiler.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("kvevents.index._core", ["kvevents/index/_core.pyx"],
                   extra_compile_args=["-O3"]),
         Extension("kvevents.ingest._zmqrecv", ["kvevents/ingest/_zmqrecv.pyx"],
                   extra_compile_args=["-O2"]),
         Extension("kvevents.api._fastbody", ["kvevents/api/_fastbody.pyx"],
                   extra_compile_args=["-O2"]),
         Extension("kvevents.gateway._pump", ["kvevents/gateway/_pump.pyx"],
                   extra_compile_args=["-O2"]),
         Extension("kvevents.text._split", ["kvevents/text/_split.pyx"],
                   extra_compile_args=["-O2"])],
        language_level=3,
    ),
)
