"""Loading and unloading LoRA adapters at run time, behind both front doors (HTTP's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter, gRPC's LoadLoraAdapter and
UnloadLoraAdapter), with vLLM's messages for the cases vLLM has.

Runtime loading is on only with --lora-load-dir DIR: an adapter's path (absolute, or
relative to DIR) must resolve, symbolic links followed, to a directory inside DIR, so a
caller cannot make the service read anything else. Only a tenant with `may_load_loras`
(or the single key of --auth-token, or anyone when no key is asked for) may load or unload.

The adapter is read and checked off the event loop while its name and slot are held
(registry.reserve), and registered only once whole: a bad adapter leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import structlog

from model_service.api.generation import GenerateError
from model_service.api.tenants import SINGLE, Tenant
from model_service.lora.peft_adapter import AdapterError, load_adapter
from model_service.lora.registry import Duplicate, LoraRegistry, SlotsFull, check_name

log = structlog.get_logger()

# Longer than any path a filesystem resolves (PATH_MAX); past it the path is not looked at.
MAX_PATH_CHARS = 4096


class LoraAdmin:
    def __init__(self, loras: LoraRegistry | None, load_dir: str | os.PathLike | None) -> None:
        self.loras = loras
        self.load_dir = Path(os.path.realpath(load_dir)) if load_dir is not None else None

    async def load(self, name: str, path: str, tenant: Tenant = SINGLE) -> str:
        """Loads the adapter at `path` under `name`; GenerateError for anything refused."""
        loras = self._check_allowed(tenant, "load")
        if not name or not path:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT,
                                "Both 'lora_name' and 'lora_path' must be provided.")
        try:
            check_name(name, f"lora_name {name[:128]!r}")
        except AdapterError as error:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, error) from None
        directory = self._resolve(path)
        try:
            loras.reserve(name)
        except Duplicate as error:
            raise GenerateError(grpc.StatusCode.ALREADY_EXISTS, error) from None
        except SlotsFull as error:
            raise GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED, error) from None
        try:
            adapter = await asyncio.to_thread(load_adapter, name, directory, loras.config, max_rank=loras.max_rank,
                                              dtype=loras.dtype, device=loras.device)
        except AdapterError as error:
            loras.unreserve(name)
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, error) from None
        except BaseException:
            loras.unreserve(name)
            raise
        loras.register(adapter)
        log.info("lora_loaded", name=name, path=str(directory), rank=adapter.rank, scaling=adapter.scaling,
                 targets=list(adapter.targets), bytes=adapter.nbytes, digest=adapter.digest[:16],
                 tenant=tenant.name or None)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str, tenant: Tenant = SINGLE) -> str:
        """Unloads `name`: new requests no longer find it; running ones finish with it."""
        loras = self._check_allowed(tenant, "unload")
        if not name:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, "'lora_name' must be provided.")
        users = loras.users(name)
        adapter = loras.unload(name) if tenant.may_use_lora(name) else None
        if adapter is None:
            shown = name if len(name) <= 128 else f"{name[:128]}..."
            raise GenerateError(grpc.StatusCode.NOT_FOUND, f"The lora adapter '{shown}' cannot be found.")
        log.info("lora_unloaded", name=name, running_requests=users, tenant=tenant.name or None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_allowed(self, tenant: Tenant, what: str) -> LoraRegistry:
        if not tenant.may_load_loras:
            raise GenerateError(grpc.StatusCode.PERMISSION_DENIED,
                                f"tenant {tenant.name!r} may not {what} LoRA adapters; its entry in --api-keys "
                                f"needs `may_load_loras: true`")
        if self.load_dir is None or self.loras is None:
            raise GenerateError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"LoRA adapters cannot be {what}ed at run time here; start the model service with "
                                f"--lora-load-dir DIR (the directory runtime adapters are loaded from)")
        return self.loras

    def _resolve(self, path: str) -> Path:
        """The adapter directory `path` names inside --lora-load-dir; INVALID_ARGUMENT for one
        outside it, NOT_FOUND for one that is not there."""
        if len(path) > MAX_PATH_CHARS or "\0" in path:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"lora_path must be a path of at most {MAX_PATH_CHARS} characters without NUL")
        assert self.load_dir is not None
        resolved = Path(os.path.realpath(self.load_dir / path))
        shown = path if len(path) <= 256 else f"{path[:256]}..."
        if resolved != self.load_dir and self.load_dir not in resolved.parents:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"lora_path {shown!r} is outside --lora-load-dir; runtime adapters load only "
                                f"from inside that directory")
        if not resolved.is_dir():
            raise GenerateError(grpc.StatusCode.NOT_FOUND,
                                f"No adapter found at lora_path {shown!r}: no such directory in --lora-load-dir")
        return resolved
