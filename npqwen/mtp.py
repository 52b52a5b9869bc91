"""Qwen3.5's multi-token-prediction head (`mtp.*`, `mtp_num_hidden_layers: 1`): a draft of token t+2
from the hidden state at t and the embedding of token t+1.

Qwen3.5, Qwen3.6 and Qwen3-Next checkpoints carry it; transformers (5.24) does not implement it (its
Qwen3.5 classes list `^mtp.*` among the keys to ignore), so this is the published formula, as vLLM's
qwen3_next_mtp.py and Qwen's own release compute it (tests/test_mtp.py builds it from HF's own modules):

    e  = pre_fc_norm_embedding(embed_tokens(x[t+1]))          # (T, D), the main model's embedding
    h  = pre_fc_norm_hidden(hidden[t])                        # (T, D), the main model's final-norm state
    y  = fc([e, h])                                           # (T, 2D) -> (T, D)
    y  = mtp.layers.0(y)                                      # one full-attention decoder layer, its own KV cache
    logits[t] = lm_head(mtp.norm(y))                          # the main model's lm_head: a guess at x[t+2]

The layer attends over the head's own keys and values of every earlier position, so the head keeps a
cache per sequence like the model's. Chained for k drafts: the head's output state (after mtp.norm) and
its draft take the place of (hidden[t], x[t+1]) one position on (vLLM's chaining).

The layer is run by the model's own code: `block` is a one-layer Qwen3 whose weights are the head's
(`mtp.layers.0.*` under `model.layers.0.*`, `mtp.norm` as its final norm) and whose embedding and lm_head
are the main model's arrays, entered with the fc's output instead of token embeddings.
"""
import dataclasses

import numpy as np

from . import ops
from .checkpoint import allocate_weights, expected_shapes, index_checkpoint, read_tensor
from .errors import NpqwenError
from .kv_cache import Batch, SequenceCache
from .model import Qwen3

HEAD = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")


class MTPHead:
    """The head's own weights (HF names: mtp.fc.weight, mtp.pre_fc_norm_*.weight) and its decoder layer (block)."""

    def __init__(self, weights: dict, block: Qwen3):
        self.weights, self.block = weights, block
        self.config, self.xp = block.config, block.xp

    def new_cache(self, capacity: int) -> SequenceCache:
        return self.block.new_cache(capacity)

    def forward(self, hidden, next_ids, cache: SequenceCache):
        """hidden (T, D): the states at positions cache.length .. + T - 1 (the main model's final-norm ones, or
        the head's own when chaining); next_ids (T,): the token after each. -> (the head's states (T, D) after
        mtp.norm, logits (T, V): its guess at the token after next)."""
        cfg, W, xp = self.config, self.weights, self.xp
        ids = np.asarray(next_ids, dtype=np.int64)
        e = ops.embed(self.block.weights["model.embed_tokens.weight"], xp.asarray(ids), 0)              # (T, D)
        e = ops.rms_norm(e, W["mtp.pre_fc_norm_embedding.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        h = ops.rms_norm(xp.asarray(hidden, dtype=e.dtype), W["mtp.pre_fc_norm_hidden.weight"], cfg.rms_norm_eps,
                         cfg.norm_offset)
        y = ops.linear(xp.concatenate([e, h], axis=-1), W["mtp.fc.weight"])                           # (T, 2D) -> (T, D)
        T, start = len(ids), cache.length
        rows = np.arange(T)
        batch = Batch(ids, [start], [T], [cache.page_table], cache.kv.page_size, sample_rows=rows, hidden_rows=rows)
        out = self.block.forward_batch(batch, cache.kv, embeds=y)
        cache.length = start + T
        return out.hidden, out.logits

    def chain(self, state, first: int, cache: SequenceCache, k: int) -> list[int]:
        """k greedy drafts: `first` (the head's guess from the sequence's last fed position, whose state
        after mtp.norm is `state` (D,)), then k - 1 more, each from the previous one's state and token.
        The chained positions are speculative: the cache is left at the length it had."""
        length, drafts, h = cache.length, [first], state[None]
        while len(drafts) < k and cache.length < cache.capacity:
            h, logits = self.forward(h, [drafts[-1]], cache)                           # (1, D), (1, V)
            drafts.append(int(np.argmax(np.asarray(logits[-1]))))
        cache.length = length
        return drafts


def load_mtp(directory, model: Qwen3) -> MTPHead:
    """The MTP head of the checkpoint in `directory` for `model` (its embedding and lm_head are shared)."""
    cfg = model.config
    found = index_checkpoint(directory) if directory is not None and cfg.hybrid else {}
    if not any(name.startswith("mtp.") for name in found):
        raise NpqwenError(f"{directory or 'this model'}: no multi-token-prediction head (mtp.* tensors); "
                          f"speculative method 'mtp' needs a Qwen3.5 / Qwen3-Next checkpoint that ships one, "
                          f"else use method 'ngram'")
    config = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=("full_attention",), mlp_only_layers=())
    shapes = {name: shape for name, shape in expected_shapes(config, lm_head=False).items()
              if name != "model.embed_tokens.weight"}
    weights, fused = allocate_weights(config, model.xp, model.dtype, shapes)
    D = cfg.hidden_size
    head = {"mtp.fc.weight": model.xp.empty((D, 2 * D), model.dtype),
            "mtp.pre_fc_norm_embedding.weight": model.xp.empty((D,), model.dtype),
            "mtp.pre_fc_norm_hidden.weight": model.xp.empty((D,), model.dtype)}
    stored = {name: "mtp.norm.weight" if name == "model.norm.weight" else name.replace("model.", "mtp.", 1)
              for name in weights}
    for name, array in [*((n, weights[n]) for n in weights), *head.items()]:
        source = stored.get(name, name)
        if source not in found:
            raise NpqwenError(f"{directory}: the MTP head's tensor {source!r} is missing")
        if tuple(found[source].shape) != tuple(array.shape):
            raise NpqwenError(f"{directory}: tensor {source!r} has shape {list(found[source].shape)}, expected "
                              f"{list(array.shape)}")
        read_tensor(found[source], array)
    weights["model.embed_tokens.weight"] = model.weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = model.weights["lm_head.weight"]
    return MTPHead(head, Qwen3(config, weights, fused))
