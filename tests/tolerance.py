"""How far two computations of the same numbers may differ, derived from what they compute.

Two paths that add the same products in another order do not round alike: OpenBLAS's AVX2, AVX-512
(and AMX machines, which run its AVX-512 float32 kernels) or torch's MKL kernels block a matrix product
differently, tensor parallelism splits a sum over the ranks and adds the halves, a batch of many is
blocked unlike a batch of one. Each rounding of a sum of n terms is off by at most eps/2 of the running
sum; when the rounding errors have random signs, the sum is off by about sqrt(n) eps/2 of its largest
terms (Higham and Mary's probabilistic bound; the worst case grows with n, never reached in practice).
A value at the end of the model has crossed `depth` such sums in a chain (each layer, the lm_head, the
rows of a triangular solve within a chunk of linear attention), each adding its own error and passing
the earlier ones on, so two paths may differ by

    MARGIN * eps * sqrt(n) * depth          relative to the largest |value| compared (taken as at least 1)

where n is the longest sum in the chain (the hidden or MLP width, or the tokens an attention or a
recurrence adds up). MARGIN = 16 covers both paths rounding (2), the largest of thousands of compared
values lying a few standard deviations out (4), and the gain of a random model (2), measured: the largest
difference seen on the AVX2 (OPENBLAS_CORETYPE=Haswell, torch at AVX2), AVX (Sandybridge) and AVX-512
(SkylakeX, what OpenBLAS runs on a Sapphire Rapids with AMX) kernels stays at least 7 times under the bound
(Qwen3.5-MoE through a LoRA adapter against PEFT: 1.5e-4 of 1.1e-3; two MPI ranks against one process:
1/18 of it). A real bug (a wrong sign, a skipped norm, a position off by one) moves the compared values by
a large fraction of their size, far above it.
"""
import math

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)   # 2**-23 = 1.19e-7
EPS64 = float(np.finfo(np.float64).eps)   # 2**-52 = 2.22e-16
MARGIN = 16
CHUNK = 64                                # the rows of linear attention's chunked triangular solve (npqwen's and HF's)


def rounding_tolerance(sum_length: int, depth: int = 1, eps: float = EPS32) -> float:
    """The relative difference two orders of rounding may give a value that crossed `depth` chained sums of
    at most `sum_length` terms (see the module's docstring)."""
    return MARGIN * eps * math.sqrt(sum_length) * depth


def model_tolerance(cfg, tokens: int, layers: int | None = None, eps: float = EPS32) -> float:
    """rounding_tolerance for a forward pass of the model `cfg` (npqwen's Qwen3Config) over `tokens` tokens up to
    its logits, or up to the output of its first `layers` layers: the longest sum is the hidden or an MLP width
    or the tokens attention reads; the chain is every layer crossed and the lm_head, and in a hybrid model
    (linear attention) the rows of one chunk's triangular solve, which each depend on the ones before, and the
    chunks' state handed on. 0 before the first layer: the embedding is a lookup, exact."""
    dense = not cfg.num_experts or cfg.mlp_only_layers or cfg.decoder_sparse_step > 1   # some layer has the dense MLP
    widths = [cfg.hidden_size, cfg.intermediate_size if dense else 0, cfg.moe_intermediate_size,
              cfg.shared_expert_intermediate_size, tokens]
    depth = cfg.num_hidden_layers + 1 if layers is None else layers
    if cfg.hybrid and depth:
        depth += min(tokens, CHUNK) + math.ceil(tokens / CHUNK)
    return rounding_tolerance(max(widths), depth, eps)


def relative_diff(got, want) -> float:
    """max |got - want| relative to the largest |want| (at least 1, so values near 0 are not blown up)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def logprob_tolerance(cfg, tokens: int, logits, eps: float = EPS32) -> float:
    """How far two paths' log-probabilities may differ when their logits differ by model_tolerance: a log
    probability is a logit minus the log-sum-exp of them all, each off by at most the largest logit error."""
    return 2 * model_tolerance(cfg, tokens, eps=eps) * max(1.0, float(np.abs(np.asarray(logits, np.float64)).max()))


def tolerance_of(llm, tokens: int, layers: int | None = None) -> float:
    """model_tolerance for a loaded model at its own float type's eps (float32, or float64 for the engine's exact
    bookkeeping checks)."""
    return model_tolerance(llm.config, tokens, layers, eps=float(np.finfo(llm.model.dtype).eps))
