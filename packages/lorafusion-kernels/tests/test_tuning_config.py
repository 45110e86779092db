"""Launch configs as data: validation, deterministic files, lookup order and fallbacks, overrides (CPU, no GPU)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from lorafusion_kernels.errors import LoRAFusionKernelsError, LoRAFusionKernelsWarning
from lorafusion_kernels.tuning import (
    ConfigFile,
    KernelConfig,
    KernelTable,
    ShapeKey,
    TunedEntry,
    clear_caches,
    gpu_key,
    lookup_config,
    override_configs,
)
from lorafusion_kernels.tuning.config import dumps
from lorafusion_kernels.tuning.tune import merge

GEMM_A = KernelConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
GEMM_B = KernelConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=4, tma=True)
GEMM_C = KernelConfig(block_m=128, block_n=128, block_k=64)


def key(m: int, n: int = 4096, k: int = 4096, r: int = 16) -> ShapeKey:
    return ShapeKey(m=m, n=n, k=k, r=r, dtype="bfloat16")


def sample_file() -> ConfigFile:
    entries = (
        TunedEntry(key=key(8192), config=GEMM_B, ms=0.4),
        TunedEntry(key=key(1024), config=GEMM_C, ms=0.1),
        TunedEntry(key=key(2048, n=14336), config=GEMM_C, ms=0.3),
    )
    return ConfigFile(
        device_name="NVIDIA Test GPU",
        device_key="nvidia_test_gpu",
        capability=(9, 0),
        provenance={
            "date": "2026-11-22",
            "torch": "2.11",
            "triton": "3.6",
            "lorafusion_kernels": "0.1.0",
            "search_space": "v1",
        },
        kernels={"xw_sb": KernelTable(default=GEMM_A, entries=entries)},
    )


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    (tmp_path / "nvidia_test_gpu.json").write_text(dumps(sample_file()))
    monkeypatch.setenv("LORAFUSION_KERNELS_CONFIG_DIR", str(tmp_path))
    clear_caches()
    yield tmp_path
    clear_caches()


def test_gpu_key_sanitises_device_names():
    assert gpu_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert gpu_key("NVIDIA H200") == "nvidia_h200"
    assert gpu_key("  NVIDIA A100-SXM4-80GB ") == "nvidia_a100_sxm4_80gb"


def test_lookup_exact_then_nearest_m_then_default(config_dir):
    def find(k: ShapeKey) -> KernelConfig:
        return lookup_config("xw_sb", k, device_name="NVIDIA Test GPU")

    assert find(key(8192)) == GEMM_B
    assert find(key(1024)) == GEMM_C
    assert find(key(5000)) == GEMM_B, "log distance: 5000 is nearer 8192 than 1024"
    assert find(key(2000)) == GEMM_C
    assert find(key(4096, n=14336)) == GEMM_C, "only the entry with the same n, k, r, dtype counts"
    assert find(key(4096, r=64)) == GEMM_A, "no entry with r=64: the kernel default"


def test_unknown_gpu_gets_the_heuristic_and_one_warning(config_dir):
    import lorafusion_kernels._kernels.lora_xw_sb  # noqa: F401  (registers the heuristic)

    with pytest.warns(LoRAFusionKernelsWarning, match="no launch configs for GPU 'Mystery GPU'") as caught:
        first = lookup_config("xw_sb", key(4096), device_name="Mystery GPU", capability=(9, 0))
    assert "or set LORAFUSION_GPU_NAME to the name of a GPU whose file is there" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = lookup_config("xw_sb", key(4096), device_name="Mystery GPU", capability=(9, 0))
    assert first == second
    assert first.block_m >= 16


def test_kernel_missing_from_file_warns_and_uses_heuristic(config_dir):
    import lorafusion_kernels._kernels.lora_xa  # noqa: F401

    with pytest.warns(LoRAFusionKernelsWarning, match="no configs for kernel 'xa'"):
        lookup_config("xa", key(4096), device_name="NVIDIA Test GPU", capability=(9, 0))


def test_gpu_name_override(config_dir, monkeypatch):
    from lorafusion_kernels.tuning.device import device_name

    monkeypatch.setenv("LORAFUSION_GPU_NAME", "NVIDIA Test GPU")
    assert device_name() == "NVIDIA Test GPU"


def test_override_configs_wins_and_restores(config_dir):
    with override_configs({"xw_sb": GEMM_C}):
        assert lookup_config("xw_sb", key(8192), device_name="NVIDIA Test GPU") == GEMM_C
    assert lookup_config("xw_sb", key(8192), device_name="NVIDIA Test GPU") == GEMM_B


def test_written_file_is_deterministic_and_round_trips():
    text = dumps(sample_file())
    assert text == dumps(ConfigFile.from_json(json.loads(text)))
    entries = json.loads(text)["kernels"]["xw_sb"]["entries"]
    assert [(e["n"], e["m"]) for e in entries] == [(4096, 1024), (4096, 8192), (14336, 2048)]
    assert text.endswith("\n")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["provenance"].pop("triton"), "provenance.triton"),
        (lambda d: d["kernels"]["xw_sb"]["default"].update(block_m=96), "power of two"),
        (lambda d: d["kernels"]["xw_sb"]["default"].update(bogus=1), "unknown field"),
        (lambda d: d["kernels"]["xw_sb"]["entries"][0].pop("m"), r"entries\[0\]\.m"),
        (lambda d: d["kernels"]["xw_sb"]["default"].update(tma=1), "tma must be"),
        (lambda d: d["device"].update(capability=[9]), "capability"),
    ],
    ids=["schema", "provenance", "block-pow2", "unknown-field", "entry-m", "tma-bool", "capability"],
)
def test_invalid_files_name_the_field(mutate, message):
    data = json.loads(dumps(sample_file()))
    mutate(data)
    with pytest.raises(LoRAFusionKernelsError, match=message):
        ConfigFile.from_json(data)


def test_kernel_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        KernelConfig(128, 128, 64)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        GEMM_A.block_m = 64  # type: ignore[misc]
    with pytest.raises(LoRAFusionKernelsError, match=">= 16"):
        KernelConfig(block_m=8, block_n=16, block_k=16)


MULTI = KernelConfig(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=4, tma=True)
MULTI_DEFAULT = KernelConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3)


def with_multi_table(base: ConfigFile) -> ConfigFile:
    """``base`` plus a ``multi_xw_sb`` table tuned at one shape (m = 8192, n = k = 4096, r = 16)."""
    table = KernelTable(default=MULTI_DEFAULT, entries=(TunedEntry(key=key(8192), config=MULTI, ms=0.5),))
    return dataclasses.replace(base, kernels={**base.kernels, "multi_xw_sb": table})


@pytest.fixture
def multi_config_dir(tmp_path, monkeypatch):
    import lorafusion_kernels._kernels.multi_lora_fwd  # noqa: F401  (registers multi_xw_sb -> xw_sb)

    (tmp_path / "nvidia_test_gpu.json").write_text(dumps(with_multi_table(sample_file())))
    monkeypatch.setenv("LORAFUSION_KERNELS_CONFIG_DIR", str(tmp_path))
    clear_caches()
    yield tmp_path
    clear_caches()


def test_multi_kernel_own_entry_then_fusedlora_entry_then_defaults(multi_config_dir):
    def find(k: ShapeKey) -> KernelConfig:
        return lookup_config("multi_xw_sb", k, device_name="NVIDIA Test GPU")

    assert find(key(8192)) == MULTI
    assert find(key(1024)) == MULTI, "its own entry for (n, k, r, dtype) at the nearest m comes first"
    assert find(key(4096, n=14336)) == GEMM_C, "no multi entry for this layer: FusedLoRA's entry for it"
    assert find(key(4096, r=64)) == MULTI_DEFAULT, "no entry of either kernel: the multi kernel's own default"
    assert lookup_config("xw_sb", key(8192), device_name="NVIDIA Test GPU") == GEMM_B, "FusedLoRA's is untouched"


def test_multi_kernel_without_a_table_gets_fusedlora_configs(config_dir):
    """Files written before the multi kernels had tables (the shipped ones) keep giving FusedLoRA's configs."""
    import lorafusion_kernels._kernels.multi_lora_fwd  # noqa: F401

    for k in (key(8192), key(1024), key(5000), key(4096, n=14336), key(4096, r=64)):
        single = lookup_config("xw_sb", k, device_name="NVIDIA Test GPU")
        assert lookup_config("multi_xw_sb", k, device_name="NVIDIA Test GPU") == single


def test_multi_kernel_missing_with_its_fallback_warns_and_uses_the_fallback_heuristic(config_dir):
    import lorafusion_kernels._kernels.multi_lora_fwd  # noqa: F401

    with pytest.warns(LoRAFusionKernelsWarning, match="'multi_xa' \\(nor for its fallback 'xa'\\)"):
        found = lookup_config("multi_xa", key(4096), device_name="NVIDIA Test GPU", capability=(9, 0))
    assert found == lookup_config("xa", key(4096), device_name=None, capability=(9, 0))
    assert lookup_config("multi_xa", key(64), device_name=None) == lookup_config("xa", key(64), device_name=None)


def test_override_is_by_exact_kernel_name(multi_config_dir):
    with override_configs({"xw_sb": GEMM_A}):
        assert lookup_config("multi_xw_sb", key(8192), device_name="NVIDIA Test GPU") == MULTI
    with override_configs({"multi_xw_sb": GEMM_A}):
        assert lookup_config("multi_xw_sb", key(8192), device_name="NVIDIA Test GPU") == GEMM_A
        assert lookup_config("xw_sb", key(8192), device_name="NVIDIA Test GPU") == GEMM_B


def test_tuned_multi_entry_round_trips_through_the_file(tmp_path):
    written = with_multi_table(sample_file())
    path = tmp_path / "nvidia_test_gpu.json"
    path.write_text(dumps(written))
    parsed = ConfigFile.from_json(json.loads(path.read_text()), where=str(path))
    assert parsed.kernels["multi_xw_sb"] == written.kernels["multi_xw_sb"]
    assert dumps(parsed) == path.read_text()


def test_merge_adds_multi_tables_and_keeps_every_sweep_on_record():
    old = dataclasses.replace(
        sample_file(), provenance={**sample_file().provenance, "sweep": "old sweep", "merged_from": "older"}
    )
    new = dataclasses.replace(
        with_multi_table(sample_file()),
        kernels={"multi_xw_sb": with_multi_table(sample_file()).kernels["multi_xw_sb"]},
        provenance={**sample_file().provenance, "date": "2026-11-23", "sweep": "new sweep", "kernels": "multi_xw_sb"},
    )
    merged = merge(old, new)
    assert merged.kernels["xw_sb"] == old.kernels["xw_sb"]
    assert merged.kernels["multi_xw_sb"] == new.kernels["multi_xw_sb"]
    assert merged.provenance["sweep"] == "new sweep"
    assert merged.provenance["merged_from"] == "2026-11-22: old sweep kernels=?; older"


def test_merge_can_keep_the_old_defaults():
    """A run over other ranks adds entries; with keep_defaults the defaults stay those of the full run."""
    old = sample_file()
    other = KernelConfig(block_m=16, block_n=16, block_k=16)
    new_entry = TunedEntry(key=ShapeKey(m=8, n=48, k=32, r=48, dtype="bfloat16"), config=other, ms=1.0)
    new = dataclasses.replace(old, kernels={"xw_sb": KernelTable(default=other, entries=(new_entry,))})
    assert merge(old, new).kernels["xw_sb"].default == other
    kept = merge(old, new, keep_defaults=True).kernels["xw_sb"]
    assert kept.default == old.kernels["xw_sb"].default
    assert kept.entries == (*old.kernels["xw_sb"].entries, new_entry)


def test_merge_refuses_another_gpus_file():
    other = dataclasses.replace(sample_file(), device_name="NVIDIA H200", device_key="nvidia_h200")
    with pytest.raises(LoRAFusionKernelsError, match="give --merge the file of this GPU"):
        merge(other, sample_file())


def test_merge_drops_entries_keyed_by_the_layer(capsys):
    """Before 2026-11-25 the tuner keyed the shrink by the layer's n; no launch looks such an entry up."""
    config = sample_file().kernels["xw_sb"].default
    stale = ShapeKey(m=8, n=64, k=32, r=16, dtype="bfloat16")
    reachable = dataclasses.replace(stale, n=16)
    entries = tuple(TunedEntry(key=key, config=config, ms=1.0) for key in (stale, reachable))
    old = dataclasses.replace(
        sample_file(), kernels={**sample_file().kernels, "xa": KernelTable(default=config, entries=entries)}
    )
    merged = merge(old, dataclasses.replace(sample_file(), kernels={}))
    assert [e.key for e in merged.kernels["xa"].entries] == [reachable]
    assert "dropped 1 entries" in capsys.readouterr().out


def rank_file(*entries: TunedEntry, default: KernelConfig = GEMM_A) -> ConfigFile:
    return dataclasses.replace(sample_file(), kernels={"xa": KernelTable(default=default, entries=entries)})


def test_an_untuned_shape_takes_the_most_frequent_winner_of_its_rank_tile():
    """Ranks 33..64 compile to one kernel; the winner most of their entries chose serves their other shapes."""
    wide = rank_file(
        TunedEntry(key=key(8192, n=48, k=4096, r=48), config=GEMM_B, ms=0.1),
        TunedEntry(key=key(8192, n=48, k=8192, r=48), config=GEMM_B, ms=0.2),
        TunedEntry(key=key(8192, n=64, k=5120, r=64), config=GEMM_C, ms=0.2),
        TunedEntry(key=key(8192, n=16, k=4096, r=16), config=GEMM_C, ms=0.1),
    )
    assert wide.lookup("xa", key(8192, n=48, k=4096, r=48)) == GEMM_B, "an entry of the shape comes first"
    assert wide.lookup("xa", key(4096, n=64, k=14336, r=64)) == GEMM_B, "two of the three rank-64-tile entries"
    assert wide.lookup("xa", key(4096, n=40, k=14336, r=40)) == GEMM_B
    assert wide.lookup("xa", key(4096, n=16, k=14336, r=16)) == GEMM_C, "rank 16's own entries"
    assert wide.lookup("xa", key(4096, n=32, k=14336, r=32)) == GEMM_A, "no entry of the rank-32 tile: the default"
    fp16 = ShapeKey(m=4096, n=64, k=14336, r=64, dtype="float16")
    assert wide.lookup("xa", fp16) == GEMM_A, "entries of another dtype do not count"


def test_a_tie_between_winners_goes_to_the_default_if_it_is_one_of_them():
    entries = (
        TunedEntry(key=key(8192, n=16, k=4096), config=GEMM_B, ms=0.1),
        TunedEntry(key=key(8192, n=16, k=8192), config=GEMM_C, ms=0.1),
    )
    untuned = key(4096, n=16, k=14336)
    assert rank_file(*entries, default=GEMM_C).lookup("xa", untuned) == GEMM_C
    assert rank_file(*entries, default=GEMM_A).lookup("xa", untuned) == GEMM_B, "default not tied: the first listed"


def test_a_multi_kernel_prefers_its_fallbacks_entry_to_its_own_rank_default(multi_config_dir):
    """Order: own entry, the fallback's entry, own rank default, the fallback's rank default, the defaults."""

    def find(k: ShapeKey) -> KernelConfig:
        return lookup_config("multi_xw_sb", k, device_name="NVIDIA Test GPU")

    assert find(key(4096, n=14336)) == GEMM_C, "FusedLoRA's entry for the shape"
    assert find(key(4096, n=9999)) == MULTI, "no entry for the shape: its own rank-16 winner"
