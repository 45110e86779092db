"""``lorafusion-tune --coverage``: where each lookup's config comes from, and what the shipped files cover (CPU)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

from lorafusion_kernels.tuning import ConfigFile, KernelConfig, KernelTable, ShapeKey, TunedEntry
from lorafusion_kernels.tuning.cli import main
from lorafusion_kernels.tuning.config import dumps, load_config_file
from lorafusion_kernels.tuning.coverage import coverage, format_coverage
from lorafusion_kernels.tuning.launches import MULTI_ADAPTER_KERNELS, SINGLE_ADAPTER_KERNELS
from lorafusion_kernels.tuning.search_space import MODEL_LAYERS

TUNED = KernelConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=4)
OTHER = KernelConfig(block_m=128, block_n=128, block_k=64)
FALLBACK = KernelConfig(block_m=32, block_n=64, block_k=32)


def key(m: int, n: int, k: int, r: int = 16) -> ShapeKey:
    return ShapeKey(m=m, n=n, k=k, r=r, dtype="bfloat16")


def made_up_file() -> ConfigFile:
    """``xw_sb`` tuned for one layer (4096 x 4096) at 8,192 tokens, rank 16; ``multi_xw_sb`` for another."""
    provenance = {"date": "-", "torch": "-", "triton": "-", "lorafusion_kernels": "-", "search_space": "-"}
    return ConfigFile(
        device_name="NVIDIA Test GPU",
        device_key="nvidia_test_gpu",
        capability=(9, 0),
        provenance=provenance,
        kernels={
            "xw_sb": KernelTable(default=OTHER, entries=(TunedEntry(key=key(8192, 4096, 4096), config=TUNED, ms=1),)),
            "multi_xw_sb": KernelTable(
                default=OTHER, entries=(TunedEntry(key=key(8192, 6144, 4096), config=FALLBACK, ms=1),)
            ),
        },
    )


def resolved(kernel: str, shape: ShapeKey, fallback: str | None = None) -> tuple[object, ...] | None:
    """``(config, kernel, source, entry_m)`` of :meth:`ConfigFile.resolve` on :func:`made_up_file`."""
    found = made_up_file().resolve(kernel, shape, fallback)
    return None if found is None else (found.config, found.kernel, found.source, found.entry_m)


def test_resolve_says_which_table_and_which_step_gave_the_config():
    assert resolved("xw_sb", key(8192, 4096, 4096)) == (TUNED, "xw_sb", "entry", 8192)
    assert resolved("xw_sb", key(2048, 4096, 4096)) == (TUNED, "xw_sb", "entry", 8192), "the nearest m"
    assert resolved("xw_sb", key(8192, 14336, 4096)) == (TUNED, "xw_sb", "rank default", None)
    assert resolved("xw_sb", key(8192, 4096, 4096, r=64)) == (OTHER, "xw_sb", "default", None), "no rank-64 entry"
    assert resolved("multi_xw_sb", key(8192, 4096, 4096), "xw_sb") == (TUNED, "xw_sb", "entry", 8192)
    assert resolved("dsx", key(8192, 16, 4096)) is None, "no table for the kernel"
    assert made_up_file().lookup("xw_sb", key(8192, 14336, 4096)) == TUNED, "lookup is resolve's config"


def test_coverage_counts_each_key_once_under_its_source():
    import lorafusion_kernels.multi_lora  # noqa: F401

    layers = [("a.o", 4096, 4096), ("a.qkv", 6144, 4096), ("a.down", 4096, 14336)]
    rows = coverage(made_up_file(), layers=layers, ms=[8192, 4096], ranks=[16], kernels=["xw_sb", "multi_xw_sb", "dsx"])
    by_key = {(row.kernel, row.key.m, row.key.n, row.key.k): row.source for row in rows}
    assert by_key[("xw_sb", 8192, 4096, 4096)] == "entry"
    assert by_key[("xw_sb", 4096, 4096, 4096)] == "entry at another m"
    assert by_key[("xw_sb", 8192, 6144, 4096)] == "rank default"
    assert by_key[("multi_xw_sb", 8192, 6144, 4096)] == "entry"
    assert by_key[("multi_xw_sb", 8192, 4096, 4096)] == "fallback's entry"
    assert by_key[("dsx", 8192, 16, 4096)] == "heuristic"
    (shrink,) = [row for row in rows if row.kernel == "dsx" and row.key == key(8192, 16, 4096)]
    assert shrink.layers == ("a.o", "a.qkv"), "the dA pass of layers with one k shares one key"
    table = format_coverage(rows)
    assert "| xw_sb | 16 | 4096 |  | 1 |  | 2 |  |  |" in table, "o: the 8,192-token entry; qkv, down: the rank default"
    assert table.index("| xw_sb |") < table.index("| multi_xw_sb |") < table.index("| dsx |"), "kernels as given"


def test_the_da_pass_writing_dx_counts_only_where_the_op_runs_it():
    import lorafusion_kernels.multi_lora  # noqa: F401

    rows = coverage(
        None, layers=[("a.o", 4096, 4096), ("a.down", 4096, 14336)], ms=[8192], ranks=[16], kernels=["multi_dsx_dx"]
    )
    assert [(row.key.k, row.layers, row.source) for row in rows] == [(4096, ("a.o",), "heuristic")]


def test_the_command_reports_a_file_and_refuses_what_it_cannot_read(tmp_path, capsys):
    path = tmp_path / "nvidia_test_gpu.json"
    path.write_text(dumps(made_up_file()))
    argv = ["--coverage", str(path), "--models", "llama-3.1-8b", "--m", "8192", "--r", "16"]
    assert main([*argv, "--kernels", "xw_sb"]) == 0
    out = capsys.readouterr().out
    assert "(NVIDIA Test GPU)" in out
    assert "| xw_sb | 16 | 8192 | 1 |  |  | 3 |" in out, "o has an entry; qkv, gate_up, down the rank default"
    assert main(["--coverage", str(tmp_path / "missing.json")]) == 2
    assert "not a file" in capsys.readouterr().out
    assert main([*argv, "--layers", "mlp"]) == 2
    assert "unknown layer 'mlp'" in capsys.readouterr().out
    assert main(["--coverage", "NVIDIA Made-up GPU", "--models", "llama-3.1-8b", "--r", "16", "--m", "8192"]) == 0
    assert "no file" in capsys.readouterr().out, "a GPU with no file: every lookup takes the heuristic"
    assert main(["--coverage", "H200", "--models", "llama-3.1-8b", "--r", "16", "--m", "8192"]) == 0
    assert "nvidia_h200.json (NVIDIA H200)" in capsys.readouterr().out, "a short name of one shipped file's GPU"
    assert main(["--coverage", "NVIDIA", "--models", "llama-3.1-8b", "--r", "16", "--m", "8192"]) == 0
    assert "no file" in capsys.readouterr().out, "a name that several files' keys hold picks none"


SHIPPED = sorted(Path(str(importlib.resources.files("lorafusion_kernels") / "configs")).glob("*.json"))


def untuned_keys(path: Path, *, ms: list[int], ranks: list[int], kernels: list[str]) -> list[tuple[object, ...]]:
    """The keys of every layer of the tuner's models that ``path`` has no entry of the kernel's own for."""
    import lorafusion_kernels.multi_lora  # noqa: F401

    layers = [(f"{model}.{layer}", n, k) for model, shapes in MODEL_LAYERS.items() for layer, n, k in shapes]
    rows = coverage(load_config_file(path), layers=layers, ms=ms, ranks=ranks, kernels=kernels)
    return [(row.kernel, row.key, row.source) for row in rows if not row.source.startswith("entry")]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_file_has_its_own_rank_16_entries_on_every_layer(path):
    """At rank 16 (the paper's) every kernel has an entry of its own on every layer of the tuner's models."""
    kernels = [*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS]
    assert untuned_keys(path, ms=[4096, 8192], ranks=[16], kernels=kernels) == []


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_file_has_its_own_ds_db_entries_at_ranks_32_to_128(path):
    """The ``dS``/``dB`` passes' tile depends on the rank (a rank default costs up to 7% there).

    Both files have their own entries at ranks 32 to 128."""
    assert untuned_keys(path, ms=[8192], ranks=[32, 64, 128], kernels=["dys_dyb", "multi_dys_dyb"]) == []


def test_the_h200_file_has_its_own_entries_for_every_kernel_at_rank_128():
    """At rank 128 the rank-16 tiles cost up to 6x on H200 (``dS``/``dB``): every kernel has its own entry there."""
    (path,) = [p for p in SHIPPED if p.stem == "nvidia_h200"]
    kernels = [*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS]
    assert untuned_keys(path, ms=[8192], ranks=[128], kernels=kernels) == []
