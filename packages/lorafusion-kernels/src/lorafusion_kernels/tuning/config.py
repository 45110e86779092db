"""Launch configs as data: one JSON file per GPU, shape-keyed entries, nearest-shape fallback.

File ``configs/<gpu-key>.json`` (or under ``LORAFUSION_KERNELS_CONFIG_DIR``)::

    {
        "schema_version": 1,
        "device": {"name": "NVIDIA H100 80GB HBM3", "key": "nvidia_h100_80gb_hbm3", "capability": [9, 0]},
        "provenance": {
            "date": "...",
            "torch": "...",
            "triton": "...",
            "lorafusion_kernels": "...",
            "search_space": "...",
        },
        "kernels": {
            "xw_sb": {
                "default": {
                    "block_m": 128,
                    "block_n": 256,
                    "block_k": 64,
                    "group_m": 8,
                    "split": 1,
                    "num_warps": 8,
                    "num_stages": 3,
                },
                "entries": [
                    {"m": 4096, "n": 4096, "k": 4096, "r": 16, "dtype": "bfloat16", "ms": 0.21, "config": {...}}
                ],
            }
        },
    }

Lookup for ``(kernel, m, n, k, r, dtype)``: the exact entry; else the entry with the same
``(n, k, r, dtype)`` and the nearest ``m`` in log distance; else the *rank default*: the config
that won the most of the kernel's entries of this dtype whose rank has the same rank tile
(``BLOCK_R``, the next power of two >= r, at least 16), ties going to the file's default; else the
kernel's default in the file; else the built-in heuristic, with one warning. An unknown GPU never
raises. The rank default exists because the best tile of the skinny passes depends on the rank
(on H100 the rank-16 shrink tile is 1.33x slower at rank 48), while the file has one default.

A kernel may name a fallback kernel (:func:`register_fallback`): the FusedMultiLoRA kernels
(``multi_xa``, ``multi_xw_sb``, ...) fall back to the FusedLoRA kernel of the same tiling. For
such a kernel the order is: its own entry for the shape (exact or nearest ``m``); else the
fallback's entry for the shape; else its own rank default; else the fallback's; else its own
default; else the fallback's default; else the heuristic. A file written before the multi-adapter
kernels had tables of their own therefore gives them FusedLoRA's configs, as it always did. Tests
and the tuner force configs with :func:`override_configs` (by exact kernel name: forcing ``xw_sb``
does not force ``multi_xw_sb``).

This module does not import torch: configs validate anywhere.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.resources
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lorafusion_kernels.errors import LoRAFusionKernelsError, OnceWarnings

SCHEMA_VERSION = 1
CONFIG_DIR_ENV = "LORAFUSION_KERNELS_CONFIG_DIR"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """How one kernel is launched. Field meanings follow each kernel's docstring."""

    block_m: int
    """Rows of the output tile (or of the row block a skinny kernel reduces over)."""
    block_n: int
    """Columns of the output tile."""
    block_k: int
    """Extent of the reduction step of the inner loop."""
    group_m: int = 8
    """Row-block group size of the L2-friendly tile order (GEMM kernels)."""
    split: int = 1
    """Programs sharing one reduction (skinny kernels); 0 picks enough to fill the GPU."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the inner loop."""
    tma: bool = False
    """GEMM kernels: load and store the big operands through tensor descriptors (TMA, sm_90+)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise LoRAFusionKernelsError(f"KernelConfig.{name} must be a positive power of two, got {value}")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 16:
                raise LoRAFusionKernelsError(f"KernelConfig.{name} must be >= 16 (tl.dot), got {getattr(self, name)}")
        if self.split < 0:
            raise LoRAFusionKernelsError(f"KernelConfig.split must be >= 0, got {self.split}")
        if self.num_stages < 1:
            raise LoRAFusionKernelsError(f"KernelConfig.num_stages must be >= 1, got {self.num_stages}")

    def to_dict(self) -> dict[str, int | bool]:
        """Plain dict with every field, for JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> KernelConfig:
        """Build from a JSON object; unknown or missing fields raise with their path in ``where``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise LoRAFusionKernelsError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(names)}")
        for key, value in data.items():
            if key == "tma":
                if not isinstance(value, bool):
                    raise LoRAFusionKernelsError(f"{where}.tma must be true or false, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise LoRAFusionKernelsError(f"{where}.{key} must be an integer, got {value!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise LoRAFusionKernelsError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeKey:
    """The problem a config was tuned for: ``x [m, k]``, ``W [n, k]``, rank ``r``, operand dtype."""

    m: int
    n: int
    k: int
    r: int
    dtype: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunedEntry:
    """One measured winner: the shape, its config and the median time in milliseconds."""

    key: ShapeKey
    config: KernelConfig
    ms: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTable:
    """Configs of one kernel on one GPU."""

    default: KernelConfig
    entries: tuple[TunedEntry, ...] = ()

    def rank_default(self, key: ShapeKey) -> KernelConfig | None:
        """The config that won the most entries of ``key``'s dtype and rank tile; None if there are none.

        The rank tile is :func:`rank_tile` of ``r``: ranks 33 to 64 compile to the same kernel. A tie
        goes to the default if it is among the tied configs, else to the tied config listed first.
        """
        tile = rank_tile(key.r)
        wins = collections.Counter(
            e.config for e in self.entries if e.key.dtype == key.dtype and rank_tile(e.key.r) == tile
        )
        if not wins:
            return None
        most = max(wins.values())
        tied = [config for config, count in wins.items() if count == most]
        return self.default if self.default in tied else tied[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resolution:
    """The config a file gives one lookup, and where in the file it was found."""

    config: KernelConfig
    kernel: str
    """The kernel whose table gave it: the one looked up, or its fallback."""
    source: str
    """``"entry"`` (of this shape), ``"rank default"`` or ``"default"``."""
    entry_m: int | None = None
    """For an entry: its ``m``, which is the nearest tuned one when it differs from the key's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigFile:
    """A parsed ``configs/<gpu-key>.json``."""

    device_name: str
    device_key: str
    capability: tuple[int, int]
    provenance: Mapping[str, str]
    kernels: Mapping[str, KernelTable]

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "<config>") -> ConfigFile:
        """Validate and parse; every error names the offending field.

        Raises:
            LoRAFusionKernelsError: on any schema violation.
        """

        def need(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
            if key not in obj:
                raise LoRAFusionKernelsError(f"{where}: missing {path}.{key}")
            value = obj[key]
            if not isinstance(value, kind):
                raise LoRAFusionKernelsError(f"{where}: {path}.{key} has wrong type {type(value).__name__}")
            return value

        if data.get("schema_version") != SCHEMA_VERSION:
            raise LoRAFusionKernelsError(
                f"{where}: schema_version must be {SCHEMA_VERSION}, got {data.get('schema_version')!r}"
            )
        device = need(data, "device", dict, "")
        capability = need(device, "capability", list, "device")
        if len(capability) != 2 or not all(isinstance(c, int) for c in capability):
            raise LoRAFusionKernelsError(f"{where}: device.capability must be two integers, got {capability!r}")
        provenance = need(data, "provenance", dict, "")
        for field in ("date", "torch", "triton", "lorafusion_kernels", "search_space"):
            need(provenance, field, str, "provenance")
        kernels: dict[str, KernelTable] = {}
        for name, table in need(data, "kernels", dict, "").items():
            path = f"kernels.{name}"
            default = KernelConfig.from_dict(need(table, "default", dict, path), f"{where}: {path}.default")
            entries = []
            for i, raw in enumerate(need(table, "entries", list, path)):
                entry_path = f"{path}.entries[{i}]"
                key = ShapeKey(
                    m=need(raw, "m", int, entry_path),
                    n=need(raw, "n", int, entry_path),
                    k=need(raw, "k", int, entry_path),
                    r=need(raw, "r", int, entry_path),
                    dtype=need(raw, "dtype", str, entry_path),
                )
                config = KernelConfig.from_dict(need(raw, "config", dict, entry_path), f"{where}: {entry_path}.config")
                ms = need(raw, "ms", (int, float), entry_path)
                entries.append(TunedEntry(key=key, config=config, ms=float(ms)))
            kernels[name] = KernelTable(default=default, entries=tuple(entries))
        return cls(
            device_name=need(device, "name", str, "device"),
            device_key=need(device, "key", str, "device"),
            capability=(capability[0], capability[1]),
            provenance=dict(provenance),
            kernels=kernels,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object, with entries sorted by ``(n, k, r, dtype, m)`` for reviewable diffs."""
        kernels: dict[str, Any] = {}
        for name in sorted(self.kernels):
            table = self.kernels[name]
            entries = sorted(table.entries, key=lambda e: (e.key.n, e.key.k, e.key.r, e.key.dtype, e.key.m))
            kernels[name] = {
                "default": table.default.to_dict(),
                "entries": [
                    {**dataclasses.asdict(e.key), "config": e.config.to_dict(), "ms": round(e.ms, 5)} for e in entries
                ],
            }
        return {
            "schema_version": SCHEMA_VERSION,
            "device": {"name": self.device_name, "key": self.device_key, "capability": list(self.capability)},
            "provenance": dict(sorted(self.provenance.items())),
            "kernels": kernels,
        }

    def nearest_entry(self, kernel: str, key: ShapeKey) -> TunedEntry | None:
        """``kernel``'s exact entry, else its nearest ``m`` (log distance) with the other fields equal, else None."""
        table = self.kernels.get(kernel)
        if table is None:
            return None
        same = [
            e for e in table.entries if (e.key.n, e.key.k, e.key.r, e.key.dtype) == (key.n, key.k, key.r, key.dtype)
        ]
        if not same:
            return None
        log_m = math.log(max(key.m, 1))
        return min(same, key=lambda e: (abs(math.log(e.key.m) - log_m), e.key.m))

    def rank_default(self, kernel: str, key: ShapeKey) -> KernelConfig | None:
        """``kernel``'s :meth:`KernelTable.rank_default` for ``key``; None if the file has no table for it."""
        table = self.kernels.get(kernel)
        return table.rank_default(key) if table is not None else None

    def resolve(self, kernel: str, key: ShapeKey, fallback: str | None = None) -> Resolution | None:
        """The file's config for ``key`` and where it came from.

        The order: an entry of ``kernel`` (exact ``m``, else the nearest), then of ``fallback``; the
        rank default of ``kernel``, then of ``fallback``; the default of ``kernel``, then of ``fallback``.

        Returns:
            None when the file has a table for neither kernel.
        """
        names = (kernel,) if fallback is None else (kernel, fallback)
        for name in names:
            entry = self.nearest_entry(name, key)
            if entry is not None:
                return Resolution(config=entry.config, kernel=name, source="entry", entry_m=entry.key.m)
        for name in names:
            config = self.rank_default(name, key)
            if config is not None:
                return Resolution(config=config, kernel=name, source="rank default")
        for name in names:
            if name in self.kernels:
                return Resolution(config=self.kernels[name].default, kernel=name, source="default")
        return None

    def lookup(self, kernel: str, key: ShapeKey, fallback: str | None = None) -> KernelConfig | None:
        """The config of :meth:`resolve`; None when the file has a table for neither kernel."""
        found = self.resolve(kernel, key, fallback)
        return found.config if found is not None else None


def rank_tile(r: int) -> int:
    """The rank extent the kernels compile for rank ``r``: the next power of two >= ``r``, at least 16."""
    return max(16, 1 << (max(r, 1) - 1).bit_length())


def dumps(config_file: ConfigFile) -> str:
    """Serialise deterministically: sorted keys, two-space indent, trailing newline."""
    return json.dumps(config_file.to_json(), indent=2, sort_keys=True) + "\n"


def config_dir() -> Path:
    """Where config files are read from: ``LORAFUSION_KERNELS_CONFIG_DIR`` or the shipped ``configs/``."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override)
    return Path(str(importlib.resources.files("lorafusion_kernels") / "configs"))


@functools.cache
def load_config_file(path: Path) -> ConfigFile | None:
    """Parse one config file (cached); None if it does not exist."""
    if not path.is_file():
        return None
    return ConfigFile.from_json(json.loads(path.read_text()), where=str(path))


Heuristic = Callable[[ShapeKey, tuple[int, int]], KernelConfig]
_HEURISTICS: dict[str, Heuristic] = {}
_FALLBACKS: dict[str, str] = {}
_OVERRIDES: dict[str, KernelConfig] = {}
_WARNED = OnceWarnings()


def register_heuristic(kernel: str, heuristic: Heuristic) -> None:
    """Register the built-in heuristic of ``kernel``: ``(shape, capability) -> KernelConfig``.

    Kernel modules call this for their own names.
    """
    _HEURISTICS[kernel] = heuristic


def register_fallback(kernel: str, fallback: str) -> None:
    """Let ``kernel`` use ``fallback``'s configs wherever a file has none of its own for a shape.

    ``kernel`` then needs no heuristic of its own: it uses ``fallback``'s. Kernel modules call this
    for kernels that share another kernel's tiling (FusedMultiLoRA's with FusedLoRA's).
    """
    _FALLBACKS[kernel] = fallback


def fallback_kernel(kernel: str) -> str | None:
    """The kernel whose configs ``kernel`` uses where a file has none of its own (:func:`register_fallback`)."""
    return _FALLBACKS.get(kernel)


@contextlib.contextmanager
def override_configs(configs: Mapping[str, KernelConfig]) -> Iterator[None]:
    """Force the config of some kernels inside the block (tests, the tuner)."""
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(configs)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def _warn_once(reason: str) -> None:
    _WARNED.warn(reason)


def launch_lookup(kernel: str, m: int, n: int, k: int, r: int, dtype: Any, device: Any) -> KernelConfig:
    """:func:`lookup_config` for a launch on ``device`` (a ``torch.device``), cached per problem.

    Runs before every kernel launch, so a problem seen before costs one dictionary lookup: the
    device name and the ``LORAFUSION_*`` environment overrides are read when a problem is first
    seen, and :func:`clear_caches` makes the next launches read them again. A config forced with
    :func:`override_configs` wins over the cache. Off the GPU the heuristic is used, silently.
    """
    forced = _OVERRIDES.get(kernel)
    if forced is not None:
        return forced
    return _launch_lookup(kernel, m, n, k, r, dtype, device)


# Bounded: the token count is part of the key, and a training run may see thousands of them.
@functools.lru_cache(maxsize=16384)
def _launch_lookup(kernel: str, m: int, n: int, k: int, r: int, dtype: Any, device: Any) -> KernelConfig:
    key = ShapeKey(m=m, n=n, k=k, r=r, dtype=dtype_name(dtype))
    if device.type != "cuda":
        return lookup_config(kernel, key, device_name=None)
    import torch

    from lorafusion_kernels.tuning.device import capability, device_name

    index = device.index if device.index is not None else torch.cuda.current_device()
    return lookup_config(kernel, key, device_name=device_name(index), capability=capability(index))


def clear_caches() -> None:
    """Forget parsed files, lookups and emitted warnings (after changing the environment overrides)."""
    load_config_file.cache_clear()
    _lookup_cached.cache_clear()
    _launch_lookup.cache_clear()
    _WARNED.clear()


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def lookup_config(
    kernel: str,
    key: ShapeKey,
    *,
    device_name: str | None,
    capability: tuple[int, int] = (0, 0),
) -> KernelConfig:
    """The launch config of ``kernel`` for ``key`` on the named device; never raises for an unknown GPU.

    Args:
        kernel: Kernel name (``"xw_sb"``, ``"dyw_dsa"``, ``"multi_xw_sb"``, ...).
        key: The problem shape.
        device_name: GPU name (None: no GPU, e.g. under the interpreter: the heuristic, silently).
        capability: Compute capability, passed to the heuristic.

    Raises:
        LoRAFusionKernelsError: if no heuristic is registered for ``kernel`` (a programming error).
    """
    if kernel in _OVERRIDES:
        return _OVERRIDES[kernel]
    # Cached per call signature and environment: this runs once per kernel launch.
    return _lookup_cached(kernel, key, device_name, capability, os.environ.get(CONFIG_DIR_ENV))


@functools.lru_cache(maxsize=4096)
def _lookup_cached(
    kernel: str, key: ShapeKey, device_name: str | None, capability: tuple[int, int], _config_dir_env: str | None
) -> KernelConfig:
    fallback = _FALLBACKS.get(kernel)
    if device_name is not None:
        from lorafusion_kernels.tuning.device import gpu_key

        gpu = gpu_key(device_name)
        found = load_config_file(config_dir() / f"{gpu}.json")
        config = found.lookup(kernel, key, fallback) if found is not None else None
        if config is not None:
            return config
        if found is None:
            from lorafusion_kernels.tuning.device import GPU_NAME_ENV

            shipped = ", ".join(sorted(path.stem for path in config_dir().glob("*.json"))) or "none"
            _warn_once(
                f"lorafusion-kernels has no launch configs for GPU {device_name!r} (looked for {gpu}.json in "
                f"{config_dir()}); using built-in heuristics. Run `lorafusion-tune` to write one, or set "
                f"{GPU_NAME_ENV} to the name of a GPU whose file is there to use it (files: {shipped})."
            )
        else:
            names = repr(kernel) if fallback is None else f"{kernel!r} (nor for its fallback {fallback!r})"
            _warn_once(f"{gpu}.json has no configs for kernel {names}; using the built-in heuristic")
    heuristic = _HEURISTICS.get(kernel) or (_HEURISTICS.get(fallback) if fallback is not None else None)
    if heuristic is None:
        raise LoRAFusionKernelsError(f"no heuristic registered for kernel {kernel!r}")
    return heuristic(key, capability)
