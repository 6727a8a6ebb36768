"""The ``--kv-transfer-config`` of real vLLM engines in a prefill/decode pair, for the
tests, the benchmark and the docs (``docs/disaggregation.md``): vLLM's stock
``ExampleConnector`` moving the KV cache through a shared folder (it runs on CPU), as
producer on a prefill engine and consumer on a decode engine; with ``offload_bytes``, the
decode engine runs it beside our offloading connector (vLLM's ``MultiConnector``: the
transfer connector loads, ours offloads to a CPU tier and publishes its events). With
``atomic``, the shared-folder connector is :mod:`connector.shared_folder`'s, whose folders
appear whole (the stock one lets a decode engine read a folder a prefill engine is
still writing: it holds for one request at a time, not under concurrency).

Pure data: importing this module needs no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["transfer_args", "transfer_config"]

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def transfer_config(role: str, folder: str | Path, offload_bytes: int = 0, atomic: bool = False) -> dict:
    """The transfer configuration of a ``prefill`` or ``decode`` engine sharing ``folder``
    (``offload_bytes`` > 0, decode only: with our offloading connector's CPU tier that size)."""
    example = {"kv_connector": "ExampleConnector", "kv_role": ROLES[role],
               "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
    if atomic:
        example.update(kv_connector="SharedFolderConnector", kv_connector_module_path="connector.shared_folder")
    if not offload_bytes:
        return example
    if role != "decode":
        raise ValueError("offload_bytes: the decode engine's CPU tier (a prefill engine's is not read)")
    ours = {"kv_connector": "KVEventsOffloadingConnector", "kv_connector_module_path": "connector.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": int(offload_bytes)}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [example, ours]}}


def transfer_args(role: str, folder: str | Path, offload_bytes: int = 0, atomic: bool = False) -> list[str]:
    """:func:`transfer_config` as ``vllm serve`` arguments."""
    return ["--kv-transfer-config", json.dumps(transfer_config(role, folder, offload_bytes, atomic))]
