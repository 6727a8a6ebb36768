"""Suite-wide collection rule for the ``cuda`` marker.

Tests marked ``cuda`` run where CUDA is available. Without it they skip, except those
that take the ``gpu`` fixture (tests/gpu/) when the GPU check's dry run asks for them
(``KVEVENTS_GPU_CHECK=cpu``, set by ``benchmarks/gpu/check.sh --cpu``): those run on CPU
tensors through the same code with host stand-ins for streams and events.
"""

from __future__ import annotations

import os

import pytest

DRY_RUN_ENV = "KVEVENTS_GPU_CHECK"


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if "cuda" in item.keywords]
    if not marked:
        return
    import torch  # only when a cuda test was collected: most of the suite never needs torch

    if torch.cuda.is_available():
        return
    dry_run = os.environ.get(DRY_RUN_ENV) == "cpu"
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in marked:
        if not (dry_run and "gpu" in getattr(item, "fixturenames", ())):
            item.add_marker(skip)
