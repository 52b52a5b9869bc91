"""Steering: a request's vectors added to the residual stream after a block, at every position and step.

    v = npqwen.steering_vector(llm, ["I love this", ...], ["I hate this", ...], layer=10)
    llm.generate("The movie was", steering=[{"layer": 10, "vector": v, "scale": 4.0}])

A steering is a list of {"layer": L, "vector": v (D,), "scale": s}: s * v is added to the output of
block L (model.layers.L) on that request's rows only, in one line of forward_batch; the other
requests of the batch run the same matrix products and get zeros. It travels with the request
beside its SamplingParams, not in them: those say how a token is drawn from the logits and are
checked without the model; a steering changes the logits themselves, holds arrays of the model's
hidden size, and is checked against the model (its size, its layers). It also keys the prefix
cache: a steered request's keys and values after block L are not an unsteered one's.

Qwen4-Exp: the residual after block L (model.layers.L, as hooks, trace and the logit lens name it) is
C = hc_count streams of D side by side, (T, C*D). A vector of D values is added to every stream (the
streams live in one space: they start as C copies of the token's embedding), as a torch forward hook
on HF's model.layers[L] adding v repeated C times does; a vector of C*D values (what steering_vector
reads there) is added as it is, stream by stream.
"""
import math
from dataclasses import dataclass

import numpy as np

from .errors import NpqwenError
from .hooks import residual_width


@dataclass(frozen=True, eq=False)
class Steer:
    layer: int              # added after this block's output
    vector: np.ndarray      # (D,) float32
    scale: float


def check_steering(steering, config, field: str = "steering") -> tuple[Steer, ...]:
    """A steering list checked against the model: each item's layer, vector (D finite numbers) and scale."""
    if steering is None:
        return ()
    if isinstance(steering, dict) or not isinstance(steering, (list, tuple)):
        raise NpqwenError(f"{field} must be a list of {{layer, vector, scale}} items, got {type(steering).__name__}")
    L, D, W, steers = config.num_hidden_layers, config.hidden_size, residual_width(config), []
    for j, item in enumerate(steering):
        at = f"{field}[{j}]"
        if isinstance(item, Steer):   # checked already (the server checks a body's, then makes the request)
            steers.append(item)
            continue
        if not isinstance(item, dict):
            raise NpqwenError(f"{at} must be an object with layer, vector and scale, got {type(item).__name__}")
        unknown = set(item) - {"layer", "vector", "scale"}
        if unknown:
            raise NpqwenError(f"{at} has unknown field {sorted(unknown)[0]!r}; it takes layer, vector and scale")
        layer, scale = item.get("layer"), item.get("scale", 1.0)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < L:
            raise NpqwenError(f"{at}.layer must be a layer from 0 to {L - 1}, got {layer!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number)) or not math.isfinite(scale):
            raise NpqwenError(f"{at}.scale must be a finite number, got {scale!r}")
        try:
            vector = np.asarray(item.get("vector"), dtype=np.float32)
        except (TypeError, ValueError):
            raise NpqwenError(f"{at}.vector must be a list of {D} numbers") from None
        if vector.shape not in ((D,), (W,)):
            streams = f", added to each of its {W // D} residual streams, or {W}: one per stream" if W != D else ""
            raise NpqwenError(f"{at}.vector must have {D} values (the model's hidden size{streams}), got shape "
                              f"{vector.shape}")
        if not np.isfinite(vector).all():
            raise NpqwenError(f"{at}.vector must hold finite numbers only")
        steers.append(Steer(int(layer), vector, float(scale)))
    return tuple(steers)


def prefix_key(steers: tuple[Steer, ...]):
    """The prefix cache's root for a steered request (None: unsteered), so its pages are only its kind's."""
    if not steers:
        return None
    return hash(tuple((s.layer, s.scale, s.vector.tobytes()) for s in steers))


def batch_steering(rows, T: int, width: int, xp, dtype) -> dict:
    """Layer -> (T, width) additions for one Batch: s * v on each steered request's rows, zeros elsewhere; width
    is the residual's (hooks.residual_width: D, Qwen4-Exp's C*D, where a (D,) v goes to each of the C streams).
    `rows` is (steers, first row, n rows) per sequence of the batch."""
    adds = {}
    for steers, first, n in rows:
        for s in steers:
            add = adds.setdefault(s.layer, np.zeros((T, width), np.float32))
            add[first:first + n] += s.scale * np.tile(s.vector, width // len(s.vector))   # (width,)
    return {layer: xp.asarray(add, dtype=dtype) for layer, add in adds.items()}


def steering_vector(llm, positive_prompts, negative_prompts, layer: int) -> np.ndarray:
    """A contrastive steering vector (D,): the mean of block `layer`'s output at the last position over the
    positive prompts, minus the same over the negative ones (repeng's mean difference). Qwen4-Exp: (C*D,), its
    C streams."""
    check_steering([{"layer": layer, "vector": np.zeros(llm.config.hidden_size)}], llm.config, "layer")

    def mean_last(prompts):
        if isinstance(prompts, str) or not prompts:
            raise NpqwenError("steering_vector needs a non-empty list of positive prompts and one of negative ones")
        name = f"model.layers.{layer}"
        return np.mean([llm.run_with_cache(p, names=[name])[1][name][-1].astype(np.float64) for p in prompts], axis=0)
    return (mean_last(positive_prompts) - mean_last(negative_prompts)).astype(np.float32)
