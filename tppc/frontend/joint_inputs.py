"""Inputs over the joint ``[context | tokens]`` sequence: captured with a derived length.

Terms:
    joint input: a tensor input that is no sequence input, with an axis (neither its batch
        axis nor the feature axis of a 3-D or larger tensor) as long as the text axis of a
        context input (axis 1 of ``(batch, text, features)``) plus the example's tokens (Chroma's pipeline passes its text mask
        followed by ones for every image token: ``attention_mask`` of ``8 + 16`` entries
        beside ``encoder_hidden_states`` of 8 text tokens and 16 image tokens).
    derived length: that axis given to torch.export as ``k · seq + rest`` (``k`` the tokens
        per unit of the sequence symbol, ``rest`` the context's length), so that the graph
        keeps it symbolic and the input grows with the tokens on every call.

    follower: a tensor input that is no sequence input, with an axis exactly as long as the
        example's units (a 1-D table of row positions beside a latent of that many patch rows,
        positions beside an embedding stream): torch.export pins the length through it, so
        it is captured as one more sequence input (:func:`follower_input`).

When the plain capture fails because torch.export pinned the length, and one such input
exists, :func:`tppc.frontend.capture.capture` captures again with the joint axis derived from
the sequence symbol. What the model does with the input is annotation's business: a
float mask ``m[:, None, None, :] * m[:, None, :, None]`` over the joint sequence is run by
its rows (:mod:`tppc.passes.annotation.key_masks`).

Example:
    >>> joint_input(bound, {"hidden_states": (1,)}, 1)                  # doctest: +SKIP
    JointInput(name='attention_mask', axis=1, rest=8, per_unit=1, source='encoder_hidden_states axis 1', tokens=16)
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

__all__ = ["JointInput", "follower_input", "joint_input"]


@dataclass(frozen=True)
class JointInput:
    """An input whose axis ``axis`` is ``rest`` context positions plus the tokens.

    Attributes:
        name: the input's parameter name.
        axis: its joint axis.
        rest: the context positions before or after the tokens (the example's text length).
        per_unit: tokens per unit of the sequence symbol (a latent's patch columns; 1 for a
            token stream).
        source: the context input's axis of length ``rest`` (``"encoder_hidden_states axis
            1"``).
        tokens: the example's token count.
    """

    name: str
    axis: int
    rest: int
    per_unit: int
    source: str
    tokens: int

    def describe(self) -> str:
        """``"input 'attention_mask' axis 1 has 24 = 8 (encoder_hidden_states axis 1) + 16
        tokens"``."""
        return (f"input {self.name!r} axis {self.axis} has {self.rest + self.tokens} = "
                f"{self.rest} ({self.source}) + {self.tokens} tokens")


def joint_input(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
                patch: int, latent: bool) -> JointInput | None:
    """The first tensor input over the joint sequence (module docstring), or None.

    Args:
        bound: the model's bound example inputs.
        axes: the sequence inputs and their axes (the first one counts the tokens).
        patch: the latent's patch size.
        latent: whether the first sequence input is a latent (its height is the axis).
    """
    tensors = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    name = next(iter(axes), None)
    if name is None:
        return None
    t, dims = tensors[name], axes[name]
    per_unit = int(t.shape[-1]) // patch if latent else 1
    tokens = (int(t.shape[-2]) // patch) * per_unit if latent else int(t.shape[dims[0]])
    for other, value in tensors.items():
        if other in axes:
            continue
        for axis, size in enumerate(value.shape):
            if not axis or (value.dim() >= 3 and axis == value.dim() - 1):
                continue  # batch and feature axes are no sequence
            rest = int(size) - tokens
            source = next((f"{n} axis 1" for n, v in tensors.items() if n != other
                           and n not in axes and v.dim() >= 3 and rest > 1
                           and int(v.shape[1]) == rest), None)  # text states (b, text, d)
            if source is not None:
                return JointInput(other, axis, rest, per_unit, source, tokens)
    return None


def follower_input(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
                   units: int, context: re.Pattern[str]) -> tuple[str, int] | None:
    """``(name, axis)`` of the first follower (module docstring), or None.

    Args:
        bound: the model's bound example inputs.
        axes: the sequence inputs and their axes.
        units: the example's units (tokens, or a latent's patch rows).
        context: names of context inputs (text states, text ids), never followers.
    """
    main = bound.arguments.get(next(iter(axes), ""))
    batch = int(main.shape[0]) if isinstance(main, torch.Tensor) and main.dim() else None
    if units < 2 or units == batch:  # a timestep per sample is no table of rows
        return None
    for name, value in bound.arguments.items():
        if not isinstance(value, torch.Tensor) or name in axes or context.search(name):
            continue
        for axis in range(value.dim()):
            if (axis or value.dim() == 1) and int(value.shape[axis]) == units:
                return name, axis
    return None
