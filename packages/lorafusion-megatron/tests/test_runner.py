from __future__ import annotations

import torch

from lorafusion_megatron.data.samples import IGNORE_INDEX
from lorafusion_megatron.packing import pack_microbatch
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.testing import lora_grads, random_job
from lorafusion_megatron.testing import plan_microbatch as microbatch
from lorafusion_megatron.testing import tiny_peft_model as tiny_peft


def _hf_reference_grads(model, job, adapter: str) -> dict[str, torch.Tensor]:
    """One right-padded batch of the whole global batch through the HF model's own mean loss."""
    model.base_model.set_adapter([adapter])
    length = max(len(s) for s in job.samples)
    ids = torch.zeros(len(job.samples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, sample in enumerate(job.samples):
        n = len(sample)
        ids[row, :n] = torch.from_numpy(sample.input_ids)
        mask[row, :n] = 1
        # HF shifts labels itself: label t is the token at t, predicted from t-1.
        trained = torch.from_numpy(sample.targets[:-1]) != IGNORE_INDEX
        labels[row, 1:n] = torch.where(trained, torch.from_numpy(sample.input_ids[1:]), IGNORE_INDEX)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    grads = {n: g for n, g in lora_grads(model).items() if f".{adapter}." in n}
    model.zero_grad(set_to_none=True)
    return grads


def test_loss_is_normalised_per_adapter_over_its_whole_global_batch() -> None:
    """A global batch split over microbatches shared with another adapter gets the gradient of the
    adapter's mean loss over that global batch (what training it alone computes)."""
    model, _ = tiny_peft()
    data = {
        "first": random_job("first", [9, 5, 12, 6], 4, seed=0),
        "second": random_job("second", [20, 3], 2, seed=1),
    }
    denominators = {(name, 0): job.global_batch_targets(0) for name, job in data.items()}
    runner = MicrobatchRunner(model, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=False)
    for mb in (
        microbatch(("first", 0, (0, 2)), ("second", 0, (1,))),
        microbatch(("second", 0, (0,)), ("first", 0, (3,))),
        microbatch(("first", 0, (1,))),
    ):
        runner.forward_backward(pack_microbatch(mb, data), denominators)
    planned = lora_grads(model)
    reference = {
        **_hf_reference_grads(model, data["first"], "first"),
        **_hf_reference_grads(model, data["second"], "second"),
    }
    assert set(planned) == set(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(planned[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_results_report_loss_sums_and_token_counts() -> None:
    model, _ = tiny_peft()
    data = {"first": random_job("first", [9, 5], 2, seed=0, prompt=3)}
    runner = MicrobatchRunner(model, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=False)
    pending = runner.forward_backward(pack_microbatch(microbatch(("first", 0, (0, 1))), data), {("first", 0): 1})
    [result] = pending.get()
    assert pending.get() is pending.get()  # read back once
    assert (result.adapter, result.global_batch, result.tokens) == ("first", 0, 14)
    assert result.targets == (9 - 3) + (5 - 3) == data["first"].global_batch_targets(0)
    assert result.loss_sum > 0


def test_fused_routing_and_activation_checkpointing_give_the_same_gradients() -> None:
    """Mixed microbatch: plain PEFT per segment == fused routing == fused recomputing one or both layers."""
    import lorafusion_kernels

    data = {"first": random_job("first", [9, 5, 12], 3, seed=0), "second": random_job("second", [7, 11], 2, seed=1)}
    denominators = {(name, 0): job.global_batch_targets(0) for name, job in data.items()}
    mb = microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    grads = []
    for fused, recomputed in ((False, 0), (True, 0), (True, 1), (True, 2)):
        model, _ = tiny_peft(recomputed_layers=recomputed)
        if fused:
            lorafusion_kernels.patch_peft_model(model)
        runner = MicrobatchRunner(
            model, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=fused
        )
        # A layer's attention runs once per forward of the layer (plain PEFT: once per adapter's
        # segment), and again where the backward recomputes it.
        layers = model.base_model.model.model.layers
        calls = [0] * len(layers)
        for index, layer in enumerate(layers):
            layer.self_attn.register_forward_hook(lambda *_, i=index, c=calls: c.__setitem__(i, c[i] + 1))
        runner.forward_backward(pack_microbatch(mb, data), denominators)
        passes = 1 if fused else len(data)
        assert calls == [passes * (2 if index < recomputed else 1) for index in range(len(layers))]
        grads.append(lora_grads(model))
    for other in grads[1:]:
        assert other.keys() == grads[0].keys()
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_activate_sets_the_adapters_of_the_first_pass() -> None:
    model, _ = tiny_peft()
    data = {"first": random_job("first", [9], 1, seed=0), "second": random_job("second", [7], 1, seed=1)}
    batch = pack_microbatch(microbatch(("second", 0, (0,)), ("first", 0, (0,))), data)
    for fused, expected in ((False, ["second"]), (True, ["first", "second"])):
        runner = MicrobatchRunner(
            model, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=fused
        )
        runner.activate(batch)
        assert sorted(model.base_model.active_adapters) == expected


def test_recomputation_in_another_thread_sees_the_forwards_routing_and_draws() -> None:
    """On a GPU, autograd runs the backward (and so the recomputation) in its own thread for the
    device, which does not see the forward's context variables; a thread of our own does the same
    on the CPU. The gradients must equal those of a backward in the forward's thread."""
    import threading

    import lorafusion_kernels
    from lorafusion_megatron.dropout_seeds import drawing_for, install_dropout_seeding

    data = {"first": random_job("first", [9, 5, 12], 3, seed=0), "second": random_job("second", [7, 11], 2, seed=1)}
    planned = microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    batch = pack_microbatch(planned, data)
    grads = []
    for elsewhere in (False, True):
        model, _ = tiny_peft(recomputed_layers=2, dropout=0.3)
        lorafusion_kernels.patch_peft_model(model)
        install_dropout_seeding(dict(enumerate(model.base_model.model.model.layers)), run_seed=0)
        runner = MicrobatchRunner(
            model, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=True
        )
        runner.activate(batch)
        with drawing_for(planned), runner._routing(batch):
            objective = sum(runner._segment_losses(batch))
        failures: list[BaseException] = []

        def backward(objective: torch.Tensor = objective, failures: list[BaseException] = failures) -> None:
            try:
                objective.backward()
            except BaseException as exc:  # re-raised in the test's thread
                failures.append(exc)

        if elsewhere:
            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
        else:
            backward()
        assert not failures, failures
        grads.append(lora_grads(model))
    assert grads[1].keys() == grads[0].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)
