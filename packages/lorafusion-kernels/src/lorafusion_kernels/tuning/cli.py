"""``lorafusion-tune``: time every candidate config of every kernel on the real layer shapes, write the winners.

Usage (on the GPU to tune; the file goes to ``--out``, named after the GPU)::

    lorafusion-tune --out packages/lorafusion-kernels/src/lorafusion_kernels/configs
    lorafusion-tune --models llama-3.1-8b --m 4096 8192 --r 16   # a quick subset
    lorafusion-tune --kernels multi_xa multi_xw_sb --merge configs/nvidia_h100_80gb_hbm3.json --time-limit 400
    lorafusion-tune --kernels xw_sb --timings a.json ...; lorafusion-tune --compare a.json b.json  # reproducible?
    lorafusion-tune --gpus 4 --r 128 --merge configs/nvidia_h200.json --keep-defaults  # one shape per GPU at a time
    lorafusion-tune --coverage nvidia_h200 --m 8192 --r 16 128  # which shapes a file has tuned (no GPU)

What a sweep times, and how, is :mod:`lorafusion_kernels.tuning.tune`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from lorafusion_kernels._kernels._common import MAX_RANK
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning.agreement import (
    agreement,
    format_agreement,
    format_regret,
    regret,
    timings_from_json,
    timings_to_json,
)
from lorafusion_kernels.tuning.config import ConfigFile, config_dir, dumps, load_config_file
from lorafusion_kernels.tuning.coverage import coverage, format_coverage
from lorafusion_kernels.tuning.device import gpu_key
from lorafusion_kernels.tuning.holdout import format_rank_default_check, rank_default_check
from lorafusion_kernels.tuning.parallel import layer_jobs, visible_gpus
from lorafusion_kernels.tuning.search_space import M_VALUES, MODEL_LAYERS, MULTI_ADAPTERS, RANKS
from lorafusion_kernels.tuning.tune import KERNELS, TIMERS, SweepPlan, merge, say, tune, tune_on_gpus


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder, then rename it.

    An interrupted write (or a ``--merge`` onto the file being replaced) leaves the old file whole.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _missing_files(option: str, *paths: Path) -> bool:
    """Whether any of ``paths`` is not a file (saying which, for ``option``)."""
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        say(f"{option}: not a file: {', '.join(missing)}")
    return bool(missing)


def _compare(first: Path, second: Path) -> int:
    """``--compare``: the agreement of two config files, or the regret of two ``--timings`` files."""
    if _missing_files("--compare", first, second):
        return 2
    try:
        docs = [json.loads(path.read_text()) for path in (first, second)]
        kinds = {"timings" in doc for doc in docs}
        if kinds == {True}:
            a, b = (timings_from_json(doc, where=str(path)) for doc, path in zip(docs, (first, second), strict=True))
            regrets = regret(a, b)
            table = format_regret(regrets) if regrets else ""
        elif kinds == {False}:
            x, y = (ConfigFile.from_json(doc, where=str(path)) for doc, path in zip(docs, (first, second), strict=True))
            agreements = agreement(x, y)
            table = format_agreement(agreements) if agreements else ""
        else:
            say("--compare: give two config files or two --timings files, not one of each")
            return 2
    except (LoRAFusionKernelsError, json.JSONDecodeError) as exc:
        say(f"--compare: {exc}")
        return 2
    say(table or "the two files share no tuned shape")
    return 0


def _check_rank_defaults(timings_path: Path, config_path: Path) -> int:
    """``--check-rank-defaults``: held-out widths of a ``--timings`` file against a config file's defaults."""
    if _missing_files("--check-rank-defaults", timings_path, config_path):
        return 2
    try:
        timings = timings_from_json(json.loads(timings_path.read_text()), where=str(timings_path))
        config_file = ConfigFile.from_json(json.loads(config_path.read_text()), where=str(config_path))
    except (LoRAFusionKernelsError, json.JSONDecodeError) as exc:
        say(f"--check-rank-defaults: {exc}")
        return 2
    rows = rank_default_check(timings, config_file)
    say(format_rank_default_check(rows) if rows else "no kernel of the config file was timed at two widths or more")
    return 0


def _coverage(gpu: str, args: argparse.Namespace) -> int:
    """``--coverage``: where each kernel's config comes from on the swept shapes, in one GPU's file."""
    path = Path(gpu) if gpu.endswith(".json") else _shipped_file(gpu)
    if gpu.endswith(".json") and _missing_files("--coverage", path):
        return 2
    try:
        layer_jobs(args.models, args.layers)
        config_file = load_config_file(path)
    except (LoRAFusionKernelsError, json.JSONDecodeError) as exc:
        say(f"--coverage: {exc}")
        return 2
    layers = [
        (f"{model}.{layer}", n, k)
        for model in args.models
        for layer, n, k in MODEL_LAYERS[model]
        if args.layers is None or layer in args.layers
    ]
    rows = coverage(config_file, layers=layers, ms=args.m, ranks=args.r, kernels=args.kernels)
    if config_file is not None:
        where = f"{path} ({config_file.device_name})"
    else:
        shipped = ", ".join(sorted(p.stem for p in config_dir().glob("*.json")))
        where = f"no file {path} (shipped: {shipped}), so the built-in heuristic serves every shape"
    say(f"{where}: where each lookup's config comes from, keys counted per kernel, r and m (bfloat16)")
    say(format_coverage(rows))
    return 0


def _shipped_file(gpu: str) -> Path:
    """The config file of GPU ``gpu`` (a device name or a file key).

    Its key's file; else the one shipped file whose key holds it as a run of whole words (``H200`` ->
    ``nvidia_h200.json``); else the key's (missing) file.
    """
    key = gpu_key(gpu)
    exact = config_dir() / f"{key}.json"
    if exact.is_file():
        return exact
    words = key.split("_")

    def holds(stem: str) -> bool:
        stem_words = stem.split("_")
        return any(stem_words[i : i + len(words)] == words for i in range(len(stem_words)))

    holding = [path for path in sorted(config_dir().glob("*.json")) if holds(path.stem)]
    return holding[0] if len(holding) == 1 else exact


def _int_in(low: int, high: int | None) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[low, high]`` (no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high if high is not None else 'inf'}]")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafusion-tune",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_LAYERS), choices=sorted(MODEL_LAYERS))
    parser.add_argument("--m", nargs="+", type=_int_in(1, None), default=M_VALUES, help="tokens per microbatch")
    parser.add_argument("--r", nargs="+", type=_int_in(1, MAX_RANK), default=RANKS, help="LoRA ranks")
    parser.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    parser.add_argument(
        "--layers", nargs="+", default=None, help="only these layers of the models (qkv, o, gate_up, down); default all"
    )
    parser.add_argument("--adapters", type=int, default=MULTI_ADAPTERS, help="adapters in the multi_* kernels' batch")
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability the kernels are timed with")
    parser.add_argument("--rep", type=int, default=30, help="repetition budget per timing, ms")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timings per candidate (even: drift cancels)")
    parser.add_argument("--timer", default="graph", choices=TIMERS, help="CUDA-graph replays or eager launches")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds after which no new shape starts")
    parser.add_argument(
        "--gpus", type=int, default=1, help="spread the sweep over this many GPUs, one process per layer shape"
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for <gpu-key>.json")
    parser.add_argument("--merge", type=Path, default=None, help="an existing file to update instead of replace")
    parser.add_argument("--keep-defaults", action="store_true", help="with --merge: keep that file's defaults")
    parser.add_argument(
        "--timings", type=Path, default=None, help="also write every candidate's time to this JSON file (see --compare)"
    )
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("A", "B"), help="only compare two tuned files' winners (no GPU)"
    )
    parser.add_argument(
        "--coverage",
        metavar="GPU",
        help="only report which swept shapes a GPU's file (a name, a key or a .json path) has tuned (no GPU)",
    )
    parser.add_argument(
        "--check-rank-defaults",
        nargs=2,
        type=Path,
        metavar=("TIMINGS", "CONFIG"),
        help="only check rank defaults on held-out widths of a --timings file against CONFIG's defaults (no GPU)",
    )
    return parser


def _plan(args: argparse.Namespace) -> SweepPlan:
    return SweepPlan(
        models=args.models,
        ms=args.m,
        ranks=args.r,
        kernels=args.kernels,
        layers=args.layers,
        p=args.p,
        adapters=args.adapters,
        rep=args.rep,
        rounds=args.rounds,
        timer=args.timer,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lorafusion-tune``."""
    args = _parser().parse_args(argv)
    if args.compare is not None:
        return _compare(*args.compare)
    if args.check_rank_defaults is not None:
        return _check_rank_defaults(*args.check_rank_defaults)
    if args.coverage is not None:
        return _coverage(args.coverage, args)
    if not torch.cuda.is_available():
        say("lorafusion-tune needs a CUDA GPU")
        return 2
    if args.adapters < 2:
        say("--adapters must be at least 2 (one adapter takes the FusedLoRA path)")
        return 2
    if args.rounds < 1:
        say("--rounds must be at least 1")
        return 2
    if not 1 <= args.gpus <= torch.cuda.device_count():
        say(f"--gpus must be between 1 and the {torch.cuda.device_count()} GPUs this process sees")
        return 2
    names = sorted({torch.cuda.get_device_name(i) for i in range(args.gpus)})
    if len(names) > 1:
        say(f"--gpus {args.gpus} spans different GPUs ({', '.join(names)}): one file holds one GPU's configs")
        return 2
    try:
        layer_jobs(args.models, args.layers)
    except LoRAFusionKernelsError as exc:
        say(str(exc))
        return 2
    merge_into = None
    if args.merge is not None and args.merge.is_file():
        merge_into = ConfigFile.from_json(json.loads(args.merge.read_text()), where=str(args.merge))
        this_gpu = gpu_key(torch.cuda.get_device_name())
        if merge_into.device_key != this_gpu:
            say(f"--merge {args.merge} holds configs for {merge_into.device_key}, not this GPU ({this_gpu})")
            return 2
    plan = _plan(args)
    status = 0
    if args.gpus == 1:
        result, timings = tune(plan, args.time_limit)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="lorafusion-tune-"))
        try:
            result, timings, outcome = tune_on_gpus(plan, visible_gpus(args.gpus), workdir, args.time_limit)
        except LoRAFusionKernelsError as exc:
            say(str(exc))
            return 1
        if outcome.skipped:
            say(f"time limit: not started: {', '.join(job.name for job in outcome.skipped)}")
        if outcome.failed:
            say(f"failed: {', '.join(job.name for job in outcome.failed)}; their logs are kept in {workdir}")
            status = 1
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.timings is not None:
        write_atomically(args.timings, json.dumps(timings_to_json(timings, result.provenance), indent=1) + "\n")
        say(f"wrote {args.timings}")
    if merge_into is not None:
        result = merge(merge_into, result, keep_defaults=args.keep_defaults)
    path = args.out / f"{result.device_key}.json"
    write_atomically(path, dumps(result))
    for name, table in sorted(result.kernels.items()):
        say(f"default {name:14s} {json.dumps(table.default.to_dict(), sort_keys=True)}")
    say(f"wrote {path}")
    return status
