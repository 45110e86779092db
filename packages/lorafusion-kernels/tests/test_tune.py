"""``lorafusion-tune``'s sweep, run on CPU: the kernels under ``TRITON_INTERPRET=1`` on a tiny shape."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable

import pytest
import torch

import lorafusion_kernels._kernels._common as common
import lorafusion_kernels.tuning.tune as tune
from lorafusion_kernels._kernels._common import interpreting
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning import ConfigFile, KernelConfig, KernelTable, ShapeKey, TunedEntry
from lorafusion_kernels.tuning.agreement import (
    ShapeTimings,
    agreement,
    regret,
    shape_regret,
    timings_from_json,
    timings_to_json,
)
from lorafusion_kernels.tuning.cli import main, write_atomically
from lorafusion_kernels.tuning.config import dumps, fallback_kernel
from lorafusion_kernels.tuning.holdout import rank_default_check
from lorafusion_kernels.tuning.launches import (
    MULTI_ADAPTER_KERNELS,
    SINGLE_ADAPTER_KERNELS,
    LayerProblem,
    config_key,
    even_segments,
    kernel_launches,
    multi_adapter_launches,
)
from lorafusion_kernels.tuning.search_space import CANDIDATES
from lorafusion_kernels.tuning.tune import (
    KERNELS,
    gpu_timer,
    interleaved_times,
    kernel_tables,
    layer_shapes,
    sweep,
)

TINY_GEMM = [
    KernelConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=1),
    KernelConfig(block_m=32, block_n=16, block_k=32, group_m=4, num_stages=1, tma=True),
]
TINY_SKINNY = [
    KernelConfig(block_m=16, block_n=16, block_k=16, split=1, num_stages=1),
    KernelConfig(block_m=32, block_n=32, block_k=32, split=2, num_stages=1),
]
# Two candidates per multi-adapter kernel (a search); one per FusedLoRA kernel (their launches run).
TINY_CANDIDATES = {
    name: (TINY_GEMM if name.endswith(("xw_sb", "dyw_dsa")) else TINY_SKINNY)[
        : 2 if name in MULTI_ADAPTER_KERNELS else 1
    ]
    for name in (*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS)
}


def made_up_gpu_file(kernels: dict[str, KernelTable]) -> ConfigFile:
    """A config file of a made-up GPU holding ``kernels``."""
    provenance = {"date": "-", "torch": "-", "triton": "-", "lorafusion_kernels": "-", "search_space": "-"}
    return ConfigFile(
        device_name="NVIDIA Test GPU", device_key="nvidia_test_gpu", capability=(9, 0), provenance=provenance,
        kernels=kernels,
    )  # fmt: skip


def wall_clock_ms(fn: Callable[[], object]) -> float:
    """One run, timed on the host (the interpreter has no CUDA events); a failing launch fails the test."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def test_every_kernel_has_candidates_and_a_launch():
    import lorafusion_kernels.multi_lora  # noqa: F401  (the multi kernels register their fallbacks)

    assert set(CANDIDATES) == set(KERNELS) == {*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS}
    for multi in MULTI_ADAPTER_KERNELS:
        assert CANDIDATES[multi] == CANDIDATES[fallback_kernel(multi)], "same tiling, same candidates"
    square = LayerProblem(m=8, n=16, k=16, r=4, dtype=torch.float32, p=0.0, adapters=2, device="cpu")
    assert set(multi_adapter_launches(square)) == set(MULTI_ADAPTER_KERNELS)
    # The op writes dx's LoRA term from the dA pass only where k <= n: nothing to tune elsewhere.
    wide_input = dataclasses.replace(square, k=32)
    assert set(kernel_launches(wide_input, MULTI_ADAPTER_KERNELS)) == set(MULTI_ADAPTER_KERNELS) - {"multi_dsx_dx"}
    with pytest.raises(KeyError, match="unknown kernels"):
        kernel_launches(square, ["xw_sb", "nope"])


def test_even_segments_split_the_tokens():
    assert even_segments(10, 4) == [3, 3, 2, 2]
    assert even_segments(4096, 4) == [1024] * 4


def test_default_is_the_most_frequent_winner():
    a, b = TINY_GEMM

    def won(m: int, config: KernelConfig) -> TunedEntry:
        return TunedEntry(key=ShapeKey(m=m, n=64, k=64, r=16, dtype="bfloat16"), config=config, ms=1.0)

    found = kernel_tables({"multi_xw_sb": [won(1, b), won(2, a), won(3, b)]}, TINY_CANDIDATES)
    assert found["multi_xw_sb"].default == b
    tie = kernel_tables({"multi_xw_sb": [won(1, b), won(2, a)]}, TINY_CANDIDATES)
    assert tie["multi_xw_sb"].default == a, "ties go to the earliest candidate"


class DriftingTimer:
    """A fake timer: launch ``i`` takes ``base[i]`` ms plus ``drift`` ms for every timing before it."""

    def __init__(self, base: list[float], drift: float) -> None:
        self.base, self.drift, self.calls = base, drift, []

    def __call__(self, launch: Callable[[], object]) -> float:
        index = launch()
        assert isinstance(index, int)
        self.calls.append(index)
        return self.base[index] + self.drift * (len(self.calls) - 1)


def test_interleaved_rounds_cancel_a_linear_drift():
    base = [1.0, 1.2, 1.1, 0.95]  # the last launch is the fastest
    launches = [lambda i=i: i for i in range(len(base))]
    one_pass = interleaved_times(launches, DriftingTimer(base, drift=0.1), rounds=1)
    assert min(range(4), key=one_pass.__getitem__) == 0, "timed one after the other, the drift decides"
    timer = DriftingTimer(base, drift=0.1)
    means = interleaved_times(launches, timer, rounds=2)
    assert timer.calls == [0, 1, 2, 3, 3, 2, 1, 0]
    assert means == pytest.approx([b + 0.35 for b in base]), "every mean shifted by the same amount"
    assert min(range(4), key=means.__getitem__) == 3


def test_a_failing_launch_is_timed_once():
    calls = []

    def timer(launch: Callable[[], object]) -> float:
        calls.append(launch())
        return math.inf if calls[-1] == "bad" else 1.0

    assert interleaved_times([lambda: "ok", lambda: "bad"], timer, rounds=4) == [1.0, math.inf]
    assert calls.count("bad") == 1
    assert calls.count("ok") == 4
    with pytest.raises(LoRAFusionKernelsError, match="rounds must be at least 1"):
        interleaved_times([lambda: "ok"], timer, rounds=0)


def test_every_launch_is_called_once_before_any_timing_and_one_that_raises_loses():
    events: list[str] = []

    def launch(i: int) -> Callable[[], object]:
        def run() -> object:
            events.append(f"call {i}")
            if i == 1:
                raise RuntimeError("out of resource: shared memory")
            return i

        return run

    def timer(fn: Callable[[], object]) -> float:
        events.append(f"time {fn()}")
        return 1.0

    assert interleaved_times([launch(0), launch(1), launch(2)], timer, rounds=2) == [1.0, math.inf, 1.0]
    assert events[:3] == ["call 0", "call 1", "call 2"], "compiled before round 0"
    assert "time 1" not in events
    assert events.count("call 1") == 1


def test_time_limit_stops_before_the_next_shape():
    result = sweep(
        shapes=[(32, 32)],
        ms=[8, 16],
        ranks=[4],
        kernels=["multi_xa"],
        timer=wall_clock_ms,
        candidates=TINY_CANDIDATES,
        device="cpu",
        time_limit_s=0.0,
    )
    assert (result.points_done, result.points_total, dict(result.entries)) == (0, 2, {})


@pytest.mark.interpret
def test_sweep_over_every_kernel_under_the_interpreter(capsys):
    if not interpreting():
        pytest.skip("set TRITON_INTERPRET=1 before starting pytest to run the kernels on CPU")
    result = sweep(
        shapes=[(48, 40)],
        ms=[37],
        ranks=[8],
        kernels=KERNELS,
        timer=wall_clock_ms,
        candidates=TINY_CANDIDATES,
        dtype=torch.float32,
        p=0.25,
        adapters=2,
        device="cpu",
    )
    assert (result.points_done, result.points_total) == (1, 1)
    log = capsys.readouterr().out
    problem = LayerProblem(m=37, n=48, k=40, r=8, dtype=torch.float32, p=0.25, adapters=2, device="cpu")
    for kernel in KERNELS:
        (entry,) = result.entries[kernel]
        assert entry.key == config_key(kernel, problem), "keyed as the op looks it up"
        assert entry.config in TINY_CANDIDATES[kernel]
        assert 0 < entry.ms < math.inf
        assert f"  {kernel} " in log, "each winner is printed with its time"
    assert [t.kernel for t in result.timings] == KERNELS
    for timed in result.timings:
        assert list(timed.times) == TINY_CANDIDATES[timed.kernel], "every candidate's time is kept, in order"
        assert timed.winner == result.entries[timed.kernel][0].config
        assert 0 < timed.current_ms < math.inf
    written = made_up_gpu_file(kernel_tables(result.entries, TINY_CANDIDATES))
    parsed = ConfigFile.from_json(json.loads(dumps(written)))
    for kernel in KERNELS:
        assert parsed.lookup(kernel, config_key(kernel, problem)) == result.entries[kernel][0].config


def test_agreement_counts_same_winners_and_time_moves(capsys, tmp_path):
    a, b = TINY_GEMM

    def table(*entries: tuple[int, KernelConfig, float]) -> KernelTable:
        found = tuple(
            TunedEntry(key=ShapeKey(m=m, n=64, k=64, r=16, dtype="bfloat16"), config=c, ms=ms) for m, c, ms in entries
        )
        return KernelTable(default=a, entries=found)

    def file(**kernels: KernelTable) -> ConfigFile:
        return made_up_gpu_file(kernels)

    first = file(xw_sb=table((1, a, 1.0), (2, a, 2.0), (3, b, 4.0)), xa=table((1, a, 1.0)))
    second = file(xw_sb=table((1, a, 1.1), (2, b, 1.5), (3, b, 4.0), (4, a, 9.0)), dsx=table((1, a, 1.0)))
    (row,) = agreement(first, second)
    assert (row.kernel, row.shapes, row.same_config) == ("xw_sb", 3, 2)
    assert row.same_config_time_spread == pytest.approx(0.05)  # median of 10% and 0%
    assert row.max_time_spread == pytest.approx(0.25)
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, config in zip(paths, (first, second), strict=True):
        path.write_text(dumps(config))
    assert main(["--compare", *map(str, paths)]) == 0
    assert "xw_sb" in capsys.readouterr().out
    assert main(["--compare", str(tmp_path / "missing.json"), str(paths[0])]) == 2
    assert "not a file" in capsys.readouterr().out


def test_regret_is_how_much_slower_each_run_timed_the_other_runs_winner(capsys, tmp_path):
    a, b = TINY_GEMM
    key = ShapeKey(m=1, n=64, k=64, r=16, dtype="bfloat16")
    other_key = dataclasses.replace(key, m=2)

    def timed(times: dict[KernelConfig, float], shape: ShapeKey = key, kernel: str = "xw_sb") -> ShapeTimings:
        return ShapeTimings(kernel, shape, times, current_ms=1.0)

    first = [timed({a: 1.0, b: 1.02}), timed({a: 2.0, b: 3.0}, other_key), timed({a: 1.0, b: 1.0}, kernel="dsx")]
    second = [timed({a: 1.1, b: 1.0}), timed({a: 2.5, b: math.inf}, other_key)]
    assert shape_regret(first[0], second[0]) == pytest.approx(0.1), "second run: a is 10% slower than its winner b"
    assert shape_regret(first[1], second[1]) == 0.0
    assert shape_regret(timed({a: 1.0, b: math.inf}), timed({a: math.inf, b: 1.0})) == math.inf
    (row,) = regret(first, second)
    assert (row.kernel, row.shapes, row.same_winner) == ("xw_sb", 2, 1)
    assert (row.median_regret, row.max_regret) == pytest.approx((0.05, 0.1))

    provenance = {"date": "-", "sweep": "m=1,2"}
    document = json.loads(json.dumps(timings_to_json(second, provenance)))
    assert document["timings"][1]["candidates"][1]["ms"] is None, "a failed candidate is null, not Infinity"
    assert timings_from_json(document) == second
    with pytest.raises(LoRAFusionKernelsError, match="not a lorafusion-tune --timings file"):
        timings_from_json({"timings": [{"kernel": "xw_sb"}]})

    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, rows in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(timings_to_json(rows, provenance)))
    assert main(["--compare", *map(str, paths)]) == 0
    assert "median regret" in capsys.readouterr().out
    config_path = tmp_path / "config.json"
    config_path.write_text(dumps(made_up_gpu_file({})))
    assert main(["--compare", str(config_path), str(paths[0])]) == 2
    assert "not one of each" in capsys.readouterr().out


def test_rank_defaults_are_checked_on_widths_the_others_did_not_see(capsys, tmp_path):
    """Hold out each width, take the rank default of the rest, and time it where the width was tuned."""
    fast, default = TINY_GEMM
    slow = KernelConfig(block_m=64, block_n=16, block_k=16)

    def shape(k: int, r: int) -> ShapeKey:
        return ShapeKey(m=8192, n=r, k=k, r=r, dtype="bfloat16")

    timings = [
        ShapeTimings("xa", shape(4096, 64), {fast: 1.0, default: 1.3, slow: 2.0}, current_ms=1.3),
        ShapeTimings("xa", shape(8192, 64), {fast: 2.0, default: 2.8, slow: 4.0}, current_ms=2.8),
        ShapeTimings("xa", shape(5120, 48), {fast: 1.6, default: 1.6, slow: 1.5}, current_ms=1.6),
        ShapeTimings("xa", shape(4096, 16), {fast: 1.0, default: 1.0}, current_ms=1.0),
        ShapeTimings("dsx", shape(4096, 64), {fast: 1.0, default: 1.0}, current_ms=1.0),
    ]
    config_file = made_up_gpu_file({"xa": KernelTable(default=default)})
    (row,) = rank_default_check(timings, config_file)
    assert (row.kernel, row.rank_tile, row.shapes) == ("xa", 64, 3), "rank 16 has one width; dsx has no table"
    # Held out: 4096 -> {fast, slow} tie, not the default: the first listed (fast); 8192 likewise;
    # 5120 -> fast (two wins). Defaults: 1.3, 1.4, 1.6 / 1.5.
    assert row.held_out_slowdown == pytest.approx((1.0 * 1.0 * 1.6 / 1.5) ** (1 / 3))
    assert row.default_slowdown == pytest.approx((1.3 * 1.4 * 1.6 / 1.5) ** (1 / 3))
    assert row.default_worst == pytest.approx(1.4)

    paths = [tmp_path / "timings.json", tmp_path / "config.json"]
    paths[0].write_text(json.dumps(timings_to_json(timings, {"date": "-"})))
    paths[1].write_text(dumps(config_file))
    assert main(["--check-rank-defaults", *map(str, paths)]) == 0
    assert "held-out" in capsys.readouterr().out
    assert main(["--check-rank-defaults", str(paths[1]), str(paths[1])]) == 2
    assert "not a lorafusion-tune --timings file" in capsys.readouterr().out


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "configs" / "gpu.json"
    write_atomically(path, "old")
    write_atomically(path, "new")
    assert path.read_text() == "new"

    def interrupted(source: str, target: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("lorafusion_kernels.tuning.cli.os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, "half")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["gpu.json"], "no temporary file is left behind"


def test_an_unknown_timer_is_refused():
    with pytest.raises(LoRAFusionKernelsError, match="unknown timer 'wall'"):
        gpu_timer(10, "wall")


def test_layers_pick_their_shapes_from_each_model():
    assert layer_shapes(["qwen2.5-32b", "llama-3.1-70b"], ["gate_up"]) == [(27648, 5120), (28672, 8192)]
    assert layer_shapes(["llama-3.1-8b"], ["o", "qkv"]) == [(4096, 4096), (6144, 4096)]
    assert len(layer_shapes(["llama-3.1-8b"])) == 4


def test_an_unknown_layer_is_refused_with_the_known_ones():
    known = r"choose from \['down', 'gate_up', 'o', 'qkv'\]"
    with pytest.raises(LoRAFusionKernelsError, match=rf"unknown layer 'gate' .* {known}"):
        layer_shapes(["llama-3.1-8b"], ["gate"])


def test_a_key_two_layers_share_is_timed_once(capsys):
    """The shrink sees only x [m, k] and A: two layers with one k give it one entry."""
    result = sweep(
        shapes=[(48, 40), (24, 40)],
        ms=[16],
        ranks=[4],
        kernels=["xa", "xw_sb"],
        timer=lambda fn: 1.0,
        candidates=TINY_CANDIDATES,
        device="cpu",
    )
    assert [e.key for e in result.entries["xa"]] == [ShapeKey(m=16, n=4, k=40, r=4, dtype="bfloat16")]
    assert [(e.key.n, e.key.k) for e in result.entries["xw_sb"]] == [(48, 40), (24, 40)]


def test_candidates_are_timed_with_exact_stages_and_the_looked_up_config_as_it_runs(monkeypatch):
    """A candidate that does not fit in shared memory must lose, not be timed with fewer stages under its name."""
    exact_when_launched: list[bool] = []

    def record(config: KernelConfig | None) -> Callable[[], object]:
        return lambda: exact_when_launched.append(common._EXACT_STAGES[0])

    def launches(problem: LayerProblem, kernels: list[str]) -> dict[str, Callable[..., Callable[[], object]]]:
        return dict.fromkeys(kernels, record)

    def timer(fn: Callable[[], object]) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(tune, "kernel_launches", launches)
    sweep(
        shapes=[(48, 40)], ms=[16], ranks=[4], kernels=["xa"], timer=timer, candidates=TINY_CANDIDATES,
        device="cpu", rounds=1,
    )  # fmt: skip
    one_pass = [True] * len(TINY_CANDIDATES["xa"]) + [False]
    assert exact_when_launched == one_pass * 2, "the untimed first calls, then round 0, both as timed"
