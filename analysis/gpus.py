"""The GPU catalog: capacities as the devices report them, and sizes with explicit units.

Capacities are ``memory.total`` as ``nvidia-smi`` prints it (MiB) with current drivers (older
drivers showed about 1.5% less: T4 15,109, A100-40GB 40,536 MiB), or ``rocm-smi``'s VRAM total
for AMD devices (one GCD of an MI250X is one PyTorch device). Each entry names its source; the
values were collected from device outputs pasted in public issues (docs/budget.md, "Which GPUs
are known?").
PyTorch itself sees a little less (``torch.cuda.get_device_properties().total_memory``: H100
about 81,082 MiB of 81,559): the CUDA context term of the budget stands for that and more. The catalog is user-extensible with one call (:func:`register_gpu`) or a JSON/TOML file
(:func:`load_catalog`, e.g. ``memsim analyze ... --gpu-file my_gpus.toml``)::

    [my-a800]                  # TOML: one table per GPU
    name = "A800 80GB"
    mib = 81251
    family = "ampere"

>>> gpu("H100-80GB").mib, gpu("h200").mib
(81559, 143771)
>>> parse_memory("24GiB"), parse_memory("80 GB"), parse_memory("81559MiB")
(25769803776, 80000000000, 85520809984)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from memsim.tracer import InputError, UsageError
from memsim.tracer.errors import closest

MiB = 1024 ** 2
GiB = 1024 ** 3


@dataclass(frozen=True)
class GPU:
    """One device: its catalog key, its name, its capacity and where that figure comes from.

    Attributes
    ----------
    key : str
        Lower-case catalog key, e.g. ``"h100-80gb"``.
    name : str
    mib : int
        Total memory as the device reports it, in MiB (2**20 bytes).
    family : str
        Architecture family (``volta``, ``turing``, ``ampere``, ``ada``, ``hopper``,
        ``blackwell``, ``cdna2``, ``cdna3``): selects the default CUDA context size.
    vendor : str
    source : str
        Where ``mib`` comes from.
    """

    key: str
    name: str
    mib: int
    family: str
    vendor: str = "nvidia"
    source: str = ""

    @property
    def bytes(self) -> int:
        return self.mib * MiB


_NVSMI = "nvidia-smi memory.total"
_CATALOG: dict[str, GPU] = {}
_ALIASES: dict[str, str] = {}


def register_gpu(key: str, name: str, mib: int, family: str, vendor: str = "nvidia",
                 source: str = "user", aliases: tuple[str, ...] = ()) -> GPU:
    """Add a catalog entry; returns it. A key or alias the catalog has already is an error
    (registering the very same entry again, e.g. loading one file twice, is not)."""
    if not isinstance(mib, int) or mib <= 0:
        raise InputError(f"GPU {key!r}: capacity mib={mib!r} must be a positive int (MiB)")
    g = GPU(key.lower(), name, mib, family, vendor, source)
    if _CATALOG.get(g.key) == g and all(_ALIASES.get(_norm(a)) == g.key for a in aliases):
        return g
    taken = [a for a in (key, *aliases) if _norm(a) in _ALIASES]
    if taken:
        raise InputError(f"GPU {taken[0]!r} is in the catalog already "
                         f"({_CATALOG[_ALIASES[_norm(taken[0])]].name})",
                         hint="give your entry another key (memsim gpus lists the catalog)")
    _CATALOG[g.key] = g
    for a in aliases:
        _ALIASES[_norm(a)] = g.key
    _ALIASES[_norm(g.key)] = g.key
    return g


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def catalog() -> dict[str, GPU]:
    """All known GPUs by key."""
    return dict(_CATALOG)


def gpu(name: str) -> GPU:
    """Look a GPU up by key or alias (case, spaces and dashes ignored)."""
    key = _ALIASES.get(_norm(name))
    if key is not None:
        return _CATALOG[key]
    keys = sorted(_CATALOG)
    close = closest(name.lower(), keys, n=len(keys), cutoff=0.0)
    raise UsageError(f"unknown GPU {name!r}",
                     hint="known (closest first): " + ", ".join(close)
                          + "; or give --memory 24GiB, or add one with --gpu-file")


def load_catalog(path: str) -> list[GPU]:
    """Register the GPUs of a JSON or TOML file: ``{key: {name, mib, family[, vendor]}}``."""
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise InputError("TOML GPU files need Python 3.11", hint="use JSON") from None
            with open(path, "rb") as f:
                data = tomllib.load(f)
        else:
            with open(path) as f:
                data = json.load(f)
    except FileNotFoundError:
        raise InputError(f"no such GPU file: {path}") from None
    except (ValueError, OSError) as e:
        raise InputError(f"cannot read GPU file {path}: {e}",
                         hint="JSON or TOML: {key: {name, mib, family}}") from None
    out = []
    for key, entry in data.items():
        if not isinstance(entry, dict) or "mib" not in entry:
            raise InputError(f"GPU file {path}: entry {key!r} needs at least 'mib'",
                             hint='e.g. [my-gpu] name = "My GPU" mib = 24564 family = "ada"')
        out.append(register_gpu(key, entry.get("name", key), entry["mib"],
                                entry.get("family", "unknown"), entry.get("vendor", "nvidia"),
                                source=f"{path}", aliases=tuple(entry.get("aliases", ()))))
    return out


_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_memory(text: str) -> int:
    """``"24GiB"`` -> bytes. Units are explicit: GB = 10**9, GiB = 2**30 (no unit: an error)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*", str(text), re.IGNORECASE)
    if not m:
        raise UsageError(f"malformed memory size {text!r}",
                         hint="a number and a unit: 24GiB, 80GB, 81559MiB (GB = 10^9 bytes, "
                              "GiB = 2^30 bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


for _k, _n, _mib, _fam, _al, _src in [
    ("a100-40gb", "A100-SXM4-40GB", 40960, "ampere", ("a100-sxm4-40gb", "a100"), _NVSMI),
    ("a100-pcie-40gb", "A100-PCIE-40GB", 40960, "ampere", (), _NVSMI),
    ("a100-80gb", "A100-SXM4-80GB", 81920, "ampere", ("a100-sxm4-80gb", "a100-pcie-80gb"),
     _NVSMI),
    ("h100-80gb", "H100 80GB HBM3", 81559, "hopper", ("h100", "h100-sxm", "h100-sxm5"), _NVSMI),
    ("h100-pcie", "H100 PCIe", 81559, "hopper", (), _NVSMI),
    ("h100-nvl", "H100 NVL", 95830, "hopper", (), _NVSMI),
    ("h200", "H200", 143771, "hopper", ("h200-141gb",), _NVSMI),
    ("b200", "B200", 183359, "blackwell", (), _NVSMI),
    ("l4", "L4", 23034, "ada", (), _NVSMI),
    ("t4", "Tesla T4", 15360, "turing", ("tesla-t4",), _NVSMI),
    ("v100-16gb", "Tesla V100-SXM2-16GB", 16384, "volta", ("v100",), _NVSMI),
    ("v100-32gb", "Tesla V100-SXM2-32GB", 32768, "volta", (), _NVSMI),
    ("a10", "A10", 23028, "ampere", ("a10g",), _NVSMI),
    ("rtx-a6000", "RTX A6000", 49140, "ampere", ("a6000",), _NVSMI),
    ("l40s", "L40S", 46068, "ada", (), _NVSMI),
    ("rtx-3090", "GeForce RTX 3090", 24576, "ampere", ("3090",), _NVSMI),
    ("rtx-4090", "GeForce RTX 4090", 24564, "ada", ("4090",), _NVSMI),
    ("rtx-5090", "GeForce RTX 5090", 32607, "blackwell", ("5090",), _NVSMI),
    ("mi250x", "MI250X (one GCD)", 65520, "cdna2", (), "68,702,699,520 B per GCD (device log)"),
    ("mi300x", "MI300X", 196288, "cdna3", (), "rocm-smi VRAM total 205,822,885,888 B"),
    ("mi325x", "MI325X", 262144, "cdna3", (), "nominal 256 GiB: no device report found"),
]:
    register_gpu(_k, _n, _mib, _fam, "amd" if _fam.startswith("cdna") else "nvidia", _src, _al)
