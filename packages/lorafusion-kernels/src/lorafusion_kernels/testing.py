"""Test helpers shipped with the package (so test suites of any package can import them).

- :func:`make_lora_inputs`: seeded inputs for a LoRA linear layer.
- :func:`rel_rms`: ``||actual - expected|| / ||expected||``.
- :func:`assert_close_to_reference`: the flash-attention rule: the fused error against a float64
  reference is at most ``factor`` times the error of eager torch in the same dtype, plus a floor.
- :func:`case_id`: readable test ids such as ``M37-N45-K29-r8-fp16``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "RMS_FLOOR",
    "LoRAInputs",
    "assert_close_to_reference",
    "case_id",
    "make_lora_inputs",
    "rel_rms",
]

RMS_FLOOR: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
"""Relative-RMS error always allowed per dtype (about 2 to 4 units of its last place)."""

_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


@dataclasses.dataclass
class LoRAInputs:
    """Inputs of one LoRA linear layer: ``x [*lead, K]``, ``weight [N, K]``, ``lora_a [r, K]``, ``lora_b [N, r]``."""

    x: torch.Tensor
    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    bias: torch.Tensor | None

    def leaves(self) -> dict[str, torch.Tensor]:
        """The tensors that require grad, by name."""
        named = {"x": self.x, "weight": self.weight, "lora_a": self.lora_a, "lora_b": self.lora_b, "bias": self.bias}
        return {k: v for k, v in named.items() if v is not None and v.requires_grad}

    def to(self, dtype: torch.dtype) -> LoRAInputs:
        """Detached copies in ``dtype`` with the same ``requires_grad`` flags (float64 for references)."""

        def conv(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.detach().to(dtype).requires_grad_(t.requires_grad)

        x, w, a, b = (self.x, self.weight, self.lora_a, self.lora_b)
        return LoRAInputs(
            x=x.detach().to(dtype).requires_grad_(x.requires_grad),
            weight=w.detach().to(dtype).requires_grad_(w.requires_grad),
            lora_a=a.detach().to(dtype).requires_grad_(a.requires_grad),
            lora_b=b.detach().to(dtype).requires_grad_(b.requires_grad),
            bias=conv(self.bias),
        )


def make_lora_inputs(
    m: int,
    n: int,
    k: int,
    r: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    lead: tuple[int, ...] | None = None,
    bias: bool = False,
    bias_grad: bool = False,
    zero_b: bool = False,
) -> LoRAInputs:
    """Seeded random inputs with realistic scales (unit activations, ``1/sqrt(K)`` weights).

    Args:
        m: Tokens (rows of x) when ``lead`` is None.
        n: Output features.
        k: Input features.
        r: LoRA rank.
        dtype: dtype of every tensor.
        device: Where to put them.
        seed: Generator seed.
        lead: Leading dims of x (their product replaces ``m``), e.g. ``(2, 19)`` for a 3-D input.
        bias: Whether to add a base bias.
        bias_grad: Whether the bias requires grad.
        zero_b: Start B at zero (PEFT's initialisation: the adapter is a no-op).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)

    shape = (*lead, k) if lead is not None else (m, k)
    x = rand(*shape).requires_grad_()
    weight = rand(n, k, scale=1.0 / math.sqrt(k))
    lora_a = rand(r, k, scale=1.0 / math.sqrt(k)).requires_grad_()
    lora_b = torch.zeros(n, r, device=device, dtype=dtype) if zero_b else rand(n, r, scale=1.0 / math.sqrt(r))
    lora_b.requires_grad_()
    b = rand(n, scale=0.1).requires_grad_(bias_grad) if bias else None
    return LoRAInputs(x=x, weight=weight, lora_a=lora_a, lora_b=lora_b, bias=b)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected||_2 / ||expected||_2`` in float64 (NaN if ``actual`` holds a NaN or inf)."""
    a = actual.detach().double()
    e = expected.detach().double().to(a.device)
    if not torch.isfinite(a).all():
        return math.nan
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def assert_close_to_reference(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    eager: torch.Tensor,
    *,
    factor: float = 2.0,
    floor: float | None = None,
) -> None:
    """Assert ``rel_rms(actual, ref) <= factor * rel_rms(eager, ref) + floor``.

    Args:
        name: What is compared (``"y"``, ``"dx"``, ...), for the message.
        actual: The fused result.
        reference: The float64 result.
        eager: Plain torch in the same dtype as ``actual``.
        factor: Allowed multiple of the eager error (2 for outputs, 3 for gradients by convention).
        floor: Error always allowed; defaults to :data:`RMS_FLOOR` of ``actual.dtype``.

    Raises:
        AssertionError: with both errors in the message.
    """
    if actual.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    err = rel_rms(actual, reference)
    eager_err = rel_rms(eager, reference)
    bound = factor * eager_err + (RMS_FLOOR.get(actual.dtype, 1e-5) if floor is None else floor)
    if not err <= bound:
        raise AssertionError(f"{name}: rel. RMS error {err:.3e} > bound {bound:.3e} (eager error {eager_err:.3e})")


def case_id(m: int | str, n: int, k: int, r: int, dtype: torch.dtype, **extra: object) -> str:
    """``M37-N45-K29-r8-fp16`` plus ``-key<value>`` for each extra field."""
    parts = [f"M{m}", f"N{n}", f"K{k}", f"r{r}", _SHORT.get(dtype, str(dtype))]
    parts += [f"{key}{value}" for key, value in extra.items()]
    return "-".join(parts)
