"""The adapters an engine knows, by name: registered ones (--lora-modules, the load route) until unloaded, and
those requests bring as LoRARequests, kept in host memory up to max_cpu_loras (least recently used go first).

A request holds its ServedAdapter itself, so unloading or evicting one never pulls it from under a request
already queued or running: it only stops new requests from naming it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from jserve.config import ModelConfig
from jserve.loader.hub import REPO_ID, cached_snapshot, hf_hub_cache
from jserve.lora.config import LoRAConfig, LoRARequest
from jserve.lora.peft import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter
from jserve.lora.slots import HostSlot, SlotLayout
from jserve.parallel.partition import WeightPlacement

log = logging.getLogger("jserve")


@dataclass(eq=False)  # (compared by identity: a reloaded adapter of the same name is another one)
class ServedAdapter:
    name: str
    int_id: int
    path: str
    host_slot: HostSlot = field(repr=False)  # its weights as one device slot takes them
    serial: int  # distinct per load: its prefix-cache namespace

    def namespace(self, salt) -> tuple:
        """The prefix-cache namespace of its requests with cache salt `salt`: K/V computed under this adapter
        is shared with no other adapter, nor with the base model."""
        return ("lora", self.serial, salt)


class AdapterRegistry:
    def __init__(self, config: LoRAConfig, base: ModelConfig, layout: SlotLayout, placement: WeightPlacement):
        """`base`: the base model's config as its checkpoint has it (adapters are checked against it)."""
        self.config, self.base, self.layout, self.placement = config, base, layout, placement
        self.registered: dict[str, ServedAdapter] = {}
        self.cached: OrderedDict[str, ServedAdapter] = OrderedDict()
        self._serials = itertools.count(1)
        self._ids = itertools.count(1_000_000)  # int ids for adapters registered without one

    def get(self, name: str) -> ServedAdapter | None:
        return self.registered.get(name) or self.cached.get(name)

    def register(self, name: str, path: str | os.PathLike, int_id: int | None = None) -> ServedAdapter:
        """Load an adapter and serve it under `name` until unregistered."""
        self._check_new(name)
        return self.add(self.read(name, path, int_id))

    def add(self, adapter: ServedAdapter) -> ServedAdapter:
        """Serve an adapter `read` made (elsewhere: reading touches nothing the engine uses) by its name."""
        self._check_new(adapter.name)
        self.registered[adapter.name] = adapter
        return adapter

    def _check_new(self, name: str) -> None:
        if not name:
            raise AdapterError("an adapter needs a name")
        if self.get(name) is not None:
            raise AdapterError(f"an adapter named {name!r} is loaded already (unload it first)")

    def unregister(self, name: str) -> ServedAdapter:
        adapter = self.registered.pop(name, None) or self.cached.pop(name, None)
        if adapter is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        log.info("LoRA adapter %s unloaded", name)
        return adapter

    def resolve(self, request: LoRARequest) -> ServedAdapter:
        """The adapter a LoRARequest names: loaded already under its name (from the same path, if it gives one),
        else read from its path and kept."""
        adapter = self.get(request.lora_name)
        if adapter is not None:
            if request.lora_path and Path(request.lora_path) != Path(adapter.path):
                raise AdapterError(f"the adapter {request.lora_name!r} is loaded from {adapter.path}, not "
                                   f"{request.lora_path}: give each adapter its own name")  # fmt: skip
            if adapter.name in self.cached:
                self.cached.move_to_end(adapter.name)
            return adapter
        if not request.lora_path:
            raise AdapterError(f"no adapter named {request.lora_name!r} is loaded, and the request gives no path")
        adapter = self.read(request.lora_name, request.lora_path, request.lora_int_id)
        self.cached[adapter.name] = adapter
        while len(self.cached) > self.config.host_capacity:
            self.cached.popitem(last=False)
        return adapter

    def __iter__(self):
        return iter([*self.registered.values(), *self.cached.values()])

    def read(self, name: str, path: str | os.PathLike, int_id: int | None = None) -> ServedAdapter:
        """The adapter in `path` (a folder or hub id), checked against the base and ready for a slot."""
        int_id = next(self._ids) if int_id is None else int_id
        folder = self._folder(path)
        weights = read_adapter(folder, self.base, self.config.max_lora_rank)
        adapter = ServedAdapter(name, int_id, str(path), self.layout.host(weights, self.placement), next(self._serials))
        log.info("LoRA adapter %s loaded from %s: rank %d, %s", name, path, weights.rank, ", ".join(weights.modules))
        return adapter

    def _folder(self, path: str | os.PathLike) -> Path:
        """A local folder, or a hub id (from the Hugging Face cache, else downloaded: its two adapter files)."""
        local = Path(path).expanduser()
        if local.is_dir() or not REPO_ID.fullmatch(str(path)):
            if not local.is_dir():
                raise AdapterError(f"{path} is neither an adapter folder nor a hub id")
            return local
        download_dir = self.config.download_dir
        cache = Path(download_dir).expanduser() if download_dir else hf_hub_cache()
        snapshot = cached_snapshot(cache, str(path), None)
        if snapshot is not None and (snapshot / CONFIG_FILE).is_file():
            return snapshot
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(path), cache_dir=cache, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
        except Exception as err:  # huggingface_hub missing, offline, or the repo unknown
            raise AdapterError(f"the adapter {path} is not in the cache {cache} and could not be downloaded: "
                               f"{err}") from None  # fmt: skip
