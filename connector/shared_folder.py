"""vLLM's ``ExampleConnector`` with folders that appear whole: a prefill/decode pair over a
shared folder that holds under concurrency (vLLM 0.32; imports vLLM).

Why: the stock connector kills a decode engine (``FileNotFoundError`` in its worker:
the engine core dies) in two ways, both met by a chat workload of shared system prompts:

* its hit test looks for the folder of the prompt's whole blocks without its last token,
  while its load reads the folder of the prompt's whole blocks. The two differ for a
  prompt of whole blocks (64 tokens: the 32-token folder is tested, the 64-token one
  read). Another prompt's folder then passes the test, and the load finds no files. Here
  a hit needs both folders;
* it writes a prompt's KV straight into its final folder, one file per layer, and two
  prompts that share their whole blocks share that folder. So a decode engine can read
  a folder that a prefill engine is still writing. Here each step's files go to a private
  ``NAME.part-*`` folder, renamed to its final name once all layers are written
  (``wait_for_save``, after the step's last layer). A rename is atomic, so a reader sees
  a folder whole or not at all. When another engine published the same folder first
  (the same KV), the copy is dropped.

Load it with ``"kv_connector": "SharedFolderConnector", "kv_connector_module_path":
"connector.shared_folder"`` and the stock connector's ``shared_storage_path``
(:func:`kvevents.demo.pd_engines.transfer_config` with ``atomic=True``). Used by
``benchmarks/bench_pd.py``; the tests use the stock connector, one request at a time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

__all__ = ["SharedFolderConnector"]


class SharedFolderConnector(ExampleConnector):
    """See the module docstring. Worker role: folders written this step, by final name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parts: dict[str, str] = {}
        self._saving = False  # (the file names of loads stay the stock ones)

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        self._saving = True
        try:
            super().save_kv_layer(*args, **kwargs)
        finally:
            self._saving = False

    def _generate_filename_debug(self, layer_name: str, token_ids: Any, mm_hashes: list[str]) -> str:
        if not self._saving:
            return super()._generate_filename_debug(layer_name, token_ids, mm_hashes)
        final = self._generate_foldername_debug(token_ids, mm_hashes, create_folder=False)
        part = self._parts.get(final)
        if part is None:
            os.makedirs(self._storage_path, exist_ok=True)
            part = self._parts[final] = tempfile.mkdtemp(prefix=os.path.basename(final) + ".part-",
                                                         dir=self._storage_path)
        return os.path.join(part, f"{layer_name}.safetensors")

    def _found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        if not super()._found_match_for_prompt(prompt_token_ids, mm_hashes):
            return False
        whole = len(prompt_token_ids) // self._block_size * self._block_size  # (what a load reads)
        return os.path.exists(self._generate_foldername_debug(
            torch.tensor(prompt_token_ids)[:whole], mm_hashes, create_folder=False))

    def wait_for_save(self) -> None:
        for final, part in self._parts.items():
            try:
                os.rename(part, final)
            except OSError:  # (published already by another engine: the same KV)
                shutil.rmtree(part, ignore_errors=True)
        self._parts.clear()
