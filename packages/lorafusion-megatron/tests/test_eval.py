"""Evaluation: the held-out split, the eval loss, and evaluation inside a training run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.data.eval_split import held_out_count, split_held_out
from lorafusion_megatron.data.job_data import JobData, load_job_data
from lorafusion_megatron.data.tokenizer import load_tokenizer
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.eval_reporting import EvalHistory
from lorafusion_megatron.evaluation import EvalLoss, Evaluator, as_one_global_batch, eval_due, pack_eval_set
from lorafusion_megatron.model import set_active_adapters
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.testing import StopAfter, assert_same_adapters, random_job, saved_adapters, tiny_peft_model
from lorafusion_megatron.trainer import Trainer


def test_held_out_split_is_seeded_disjoint_and_ordered() -> None:
    items = list(range(20))
    train, held = split_held_out(items, 0.25, seed=7, source="d")
    assert len(held) == 5
    assert sorted(train + held) == items
    assert train == sorted(train)
    assert held == sorted(held)
    assert split_held_out(items, 0.25, seed=7, source="d") == (train, held)
    assert split_held_out(items, 0.25, seed=8, source="d")[1] != held
    assert len(split_held_out(items, 3, seed=7, source="d")[1]) == 3
    assert held_out_count(10, 0.01, source="d") == 1  # a fraction rounds up: never an empty eval set
    with pytest.raises(TrainerError, match="val_size = 10 holds out 10 of its 10 samples, leaving none to train on"):
        held_out_count(10, 10, source="d")


def test_eval_due_every_eval_steps_and_at_the_last_step() -> None:
    assert [s for s in range(1, 8) if eval_due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if eval_due(s, 7, None)] == [7]


def _ids(samples) -> set[bytes]:
    return {s.input_ids.tobytes() for s in samples}


def test_val_size_holds_samples_out_of_training(config_dict, jsonl_factory) -> None:
    path = jsonl_factory("words", 20, seed=3)
    job = {"name": "words", "dataset": {"path": str(path), "shuffle": True}, "global_batch_size": 4, "val_size": 0.2}
    config = parse_config(config_dict(jobs=[job]))
    tokenizer = load_tokenizer(config.base_model, vocab_size=512)
    data = load_job_data(config, config.jobs[0], tokenizer, 512)
    assert (len(data.samples), len(data.eval_samples)) == (16, 4)
    assert len(data) == 16
    assert not _ids(data.samples) & _ids(data.eval_samples)
    again = load_job_data(config, config.jobs[0], tokenizer, 512)
    assert [s.input_ids.tolist() for s in again.eval_samples] == [s.input_ids.tolist() for s in data.eval_samples]
    reseeded = parse_config(config_dict(jobs=[job], runtime={"device": "cpu", "seed": 1}))
    assert _ids(load_job_data(reseeded, reseeded.jobs[0], tokenizer, 512).eval_samples) != _ids(data.eval_samples)


def test_eval_dataset_has_its_own_fields_and_leaves_training_alone(config_dict, jsonl_factory, tmp_path) -> None:
    path = jsonl_factory("words", 8, seed=3)
    eval_path = tmp_path / "data" / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"question": q, "answer": "ok"}) + "\n" for q in ("a", "bb", "ccc")))
    plain = {"name": "words", "dataset": {"path": str(path)}, "global_batch_size": 4}
    evaluated = {
        **plain,
        "eval_dataset": {"path": str(eval_path), "prompt_field": "question", "response_field": "answer"},
    }
    config = parse_config(config_dict(jobs=[evaluated]))
    tokenizer = load_tokenizer(config.base_model, vocab_size=512)
    data = load_job_data(config, config.jobs[0], tokenizer, 512)
    assert [s.num_targets for s in data.eval_samples] == [3, 3, 3]  # "ok" + EOS
    reference = load_job_data(parse_config(config_dict(jobs=[plain])), config.jobs[0], tokenizer, 512)
    assert data.sample_tokens == reference.sample_tokens
    missing = parse_config(config_dict(jobs=[{**plain, "eval_dataset": {"path": str(tmp_path / "nope.jsonl")}}]))
    with pytest.raises(TrainerError, match=r"fix `eval_dataset\.path`"):
        load_job_data(missing, missing.jobs[0], tokenizer, 512)


def _per_sample_eval_loss(model, adapter: str, samples) -> float:
    """The reference: each sample alone through the model with only ``adapter`` active, no dropout."""
    set_active_adapters(model, [adapter])
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            logits = model(input_ids=torch.from_numpy(sample.input_ids)[None]).logits[0].double()
            targets = torch.from_numpy(sample.targets)
            total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            count += sample.num_targets
    model.train()
    return total / count


# On the CPU the patched layers fall back to PEFT's own path (with one warning): the routing is still exercised.
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")
@pytest.mark.parametrize("fused", [False, True], ids=["plain-peft", "fused"])
def test_eval_loss_is_the_token_weighted_mean_of_per_sample_losses(config_dict, fused: bool) -> None:
    """Packed over several (mixed-length) microbatches, in eval mode: the per-sample reference, to rounding.

    Dropout is on, so an evaluation that ran in training mode would miss; gradients accumulated
    before it and the random generator must come out untouched.
    """
    model, _ = tiny_peft_model(dropout=0.3)
    if fused:
        import lorafusion_kernels

        lorafusion_kernels.patch_peft_model(model)
    first = random_job("first", [9, 30, 5, 17, 12, 21], 2, seed=4)
    second = random_job("second", [7, 11], 2, seed=5)
    data = {
        "first": JobData(
            name="first", samples=second.samples, order=np.arange(2), global_batch_size=2, eval_samples=first.samples
        ),
        "second": second,
    }
    config = parse_config(config_dict(scheduler={"capacity": 32, "padding_multiple": 16}))
    runner = MicrobatchRunner(model, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=fused)
    evaluator = Evaluator(runner, data, config, torch.device("cpu"))
    assert evaluator.adapters == ("first",)
    assert len(pack_eval_set(as_one_global_batch("first", first.samples), config)) >= 3
    parameters = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in parameters:
        p.grad = torch.full_like(p, 0.5)
    rng = torch.get_rng_state()
    result = evaluator.evaluate("first", step=3)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in parameters)
    assert model.training
    assert (result.step, result.samples) == (3, 6)
    assert result.targets == sum(s.num_targets for s in first.samples)
    expected = _per_sample_eval_loss(model, "first", first.samples)
    assert result.loss == pytest.approx(expected, rel=1e-5)


def test_a_resumed_history_keeps_what_its_checkpoint_had_done(tmp_path: Path, caplog) -> None:
    """Records after the checkpoint's step (written before a crash) are dropped: the resumed run redoes them."""
    path = tmp_path / "eval_history.json"
    history = EvalHistory(path, ["first", "second"])
    for step in (1, 2, 3, 4):
        history.add(EvalLoss(adapter="first", step=step, loss=1.0 / step, samples=3, targets=9, seconds=0.1))
    resumed = EvalHistory.resumed(path, ["first", "second"], {"first": 2, "second": 0}, written_by=["first"])
    assert [r.step for r in resumed.records["first"]] == [1, 2]
    assert resumed.latest("first") == history.records["first"][1]
    assert resumed.latest("second") is None
    path.unlink()
    with caplog.at_level("WARNING"):
        assert EvalHistory.resumed(path, ["first"], {"first": 2}, written_by=["first"]).records == {"first": []}
    assert "is missing, though the interrupted run wrote it: evaluations before the resume are left out" in caplog.text


def test_a_missing_history_is_warned_about_only_when_the_interrupted_run_wrote_it(tmp_path: Path, caplog) -> None:
    """A resume that adds an eval_dataset found no file (the run before did not evaluate) and warned of lost records."""
    path = tmp_path / "eval_history.json"
    with caplog.at_level("WARNING"):
        assert EvalHistory.resumed(path, ["first"], {"first": 2}, written_by=[]).records == {"first": []}
        assert EvalHistory.resumed(path, ["first"], {"first": 0}, written_by=["first"]).records == {"first": []}
    assert not caplog.records


@pytest.mark.parametrize(
    "content", ['{"first": [', '["first"]', '{"first": [{"stp": 1}]}'], ids=["cut", "list", "keys"]
)
@pytest.mark.parametrize("evaluating", [["first"], []], ids=["evaluates", "evaluates-no-more"])
def test_a_damaged_history_is_kept_aside_and_warned_about(
    tmp_path: Path, caplog, content: str, evaluating: list[str]
) -> None:
    """A damaged file was deleted without a word when no job evaluated any more."""
    path = tmp_path / "eval_history.json"
    path.write_text(content)
    with caplog.at_level("WARNING"):
        history = EvalHistory.resumed(path, evaluating, {"first": 2}, written_by=[])
    assert history.records == {name: [] for name in evaluating}
    assert f"{path} is damaged" in caplog.text
    assert "kept as eval_history.json.damaged" in caplog.text
    assert not path.exists()
    assert (tmp_path / "eval_history.json.damaged").read_text() == content


def test_a_resume_that_adds_an_eval_dataset_warns_of_no_lost_history(run_config, tmp_path: Path, caplog) -> None:
    plain = run_config("run")
    assert Trainer(plain, stop=StopAfter(3)).train().interrupted
    eval_path = str(tmp_path / "data" / "first-eval.jsonl")
    evaluated = run_config("run", first={"eval_dataset": {"path": eval_path}, "eval_steps": 2})
    with caplog.at_level("WARNING"):
        Trainer(evaluated).train(resume=True)
    assert "left out of the summary" not in caplog.text
    summary = json.loads((Path(evaluated.output_dir) / "summary.json").read_text())
    assert summary["eval"]["first"][-1]["step"] == 5, "the resumed run evaluates"


def test_a_resume_with_another_eval_set_keeps_both_sets_losses_apart_and_says_so(
    run_config, jsonl_factory, tmp_path: Path, caplog
) -> None:
    """Each record names the hash of the eval set it measured; a resume with other eval samples warns."""
    jsonl_factory("first-eval-other", 4, seed=3)
    data = tmp_path / "data"

    def config(eval_file: str, name: str = "run"):
        return run_config(name, first={"eval_dataset": {"path": str(data / eval_file)}, "eval_steps": 2})

    assert Trainer(config("first-eval.jsonl"), stop=StopAfter(3)).train().interrupted
    with caplog.at_level("WARNING"):
        Trainer(config("first-eval-other.jsonl")).train(resume=True)
    history = json.loads((tmp_path / "run" / "eval_history.json").read_text())["first"]
    assert [(r["step"], r["samples"]) for r in history] == [(2, 5), (4, 4), (5, 4)]
    earlier, later = history[0]["eval_set"], history[1]["eval_set"]
    assert len(earlier) == len(later) == 16
    assert earlier != later
    assert history[2]["eval_set"] == later
    assert (
        f"first's eval_dataset holds other samples than when it was evaluated up to step 2: its history keeps "
        f"those losses (eval_set {earlier}) beside the new set's (eval_set {later})" in caplog.text
    )
    caplog.clear()
    assert Trainer(config("first-eval.jsonl", "same"), stop=StopAfter(3)).train().interrupted
    with caplog.at_level("WARNING"):
        Trainer(config("first-eval.jsonl", "same")).train(resume=True)
    assert "eval_dataset holds other samples" not in caplog.text, "the same eval set: no warning"


@pytest.fixture
def run_config(config_dict, tiny_base: Path, jsonl_factory, tmp_path: Path):
    """Two jobs on the tiny local model with dropout: ``first`` from JSONL, ``second`` synthetic."""
    jsonl_factory("first", 12, seed=1)
    jsonl_factory("first-eval", 5, seed=2)

    def make(name: str, *, first: dict | None = None, **top):
        jobs = [
            {
                "name": "first",
                "dataset": {"path": str(tmp_path / "data" / "first.jsonl")},
                "r": 4,
                "lora_alpha": 8,
                "lora_dropout": 0.1,
                "target_modules": ["q_proj", "v_proj"],
                "learning_rate": 1e-2,
                "global_batch_size": 2,
                "max_steps": 5,
                **(first or {}),
            },
            {
                "name": "second",
                "dataset": {"synthetic": "xsum", "num_samples": 6, "length_scale": 0.04},
                "r": 2,
                "lora_dropout": 0.1,
                "target_modules": ["q_proj"],
                "global_batch_size": 3,
                "max_steps": 3,
            },
        ]
        base = {"model_name_or_path": str(tiny_base), "dtype": "float32", "attn_implementation": "sdpa"}
        return parse_config(config_dict(jobs=jobs, base_model=base, output_dir=str(tmp_path / name), **top))

    return make


@pytest.mark.together
def test_evaluation_does_not_change_training_and_is_reported(run_config, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = run_config("plain")
    Trainer(plain).train()
    eval_path = str(tmp_path / "data" / "first-eval.jsonl")
    evaluated = run_config(
        "evaluated",
        first={"eval_dataset": {"path": eval_path}, "eval_steps": 2},
        logging={"progress_bar": False, "tensorboard_dir": str(tmp_path / "tb")},
    )
    Trainer(evaluated).train()
    assert_same_adapters(saved_adapters(evaluated), saved_adapters(plain))

    summary = json.loads((Path(evaluated.output_dir) / "summary.json").read_text())
    history = summary["eval"]["first"]
    assert [record["step"] for record in history] == [2, 4, 5]
    assert all(record["samples"] == 5 and record["targets"] > 0 for record in history)
    jobs = {job["name"]: job for job in summary["jobs"]}
    assert jobs["first"]["eval_loss"] == history[-1]["loss"]
    assert jobs["second"]["eval_loss"] is None
    assert "second" not in summary["eval"]
    saved = json.loads((Path(evaluated.output_dir) / "eval_history.json").read_text())
    assert saved == summary["eval"]
    events = EventAccumulator(str(tmp_path / "tb" / "first"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/loss")] == [
        (r["step"], r["loss"]) for r in history
    ]


def test_resume_keeps_the_split_and_the_eval_history(run_config) -> None:
    """Interrupted between evaluations and resumed: same adapters, same eval losses, no record twice."""
    held_out = {"val_size": 0.25, "eval_steps": 1}
    straight = run_config("straight", first=held_out)
    Trainer(straight).train()
    resumed = run_config("resumed", first=held_out, save_total_limit=None)
    first = Trainer(resumed, stop=StopAfter(3)).train()
    assert first.interrupted
    Trainer(resumed).train(resume=True)
    assert_same_adapters(saved_adapters(resumed), saved_adapters(straight))
    expected = json.loads((Path(straight.output_dir) / "summary.json").read_text())["eval"]
    actual = json.loads((Path(resumed.output_dir) / "summary.json").read_text())["eval"]
    assert [r["step"] for r in actual["first"]] == [1, 2, 3, 4, 5]
    assert [(r["step"], r["loss"], r["targets"]) for r in actual["first"]] == [
        (r["step"], r["loss"], r["targets"]) for r in expected["first"]
    ]
