"""Requests that only read their prompt: embeddings (a pooled hidden state) and scores (a few logits).

They go through the scheduler like any request: admitted under the same budget, their prompts
chunked and packed beside everyone else's tokens (no padding), preempted when pages run short,
their full pages shared through the prefix cache. They never sample and never decode. In each
step the model hands back, for an "embed" request, the final-norm hidden states of only the
positions its pooling reads (npqwen/embed.py), and for a "score" request, on its last chunk, the
logits of only its few tokens (the reranker's "no" and "yes"): nothing is computed over the
vocabulary. The step that reads the last chunk finishes the request and frees its pages.
"""
import numpy as np

from ..backend import to_numpy
from ..embed import pool_chunk, pooled_positions, pooled_vector
from .request import Request, StepOutput


class PrefillRows:
    """Which rows of one step's batch the prefill-only requests of its plan read, and where they land."""

    def __init__(self, plan: list[tuple[Request, int]], ends: np.ndarray):
        hidden, score, ids = [], [], []
        self.where: dict[str, tuple] = {}    # request id -> its slice of the step's hidden states, or its row of scores
        for (req, n), end in zip(plan, ends):
            first = int(end) - n             # the batch row of its first token in this step
            if req.task == "embed":
                positions = pooled_positions(req.pooling, req.cached_len, n, len(req.tokens), req.pooled_upto)
                self.where[req.request_id] = slice(len(hidden), len(hidden) + len(positions))
                hidden += [first + p - req.cached_len for p in positions]
            elif req.task == "score" and req.cached_len + n == len(req.tokens):
                self.where[req.request_id] = len(score)
                score.append(int(end) - 1)
                ids.append(list(req.score_ids))
        self.batch_fields = dict(hidden_rows=np.array(hidden, dtype=np.int64),
                                 score_rows=np.array(score, dtype=np.int64),
                                 score_ids=np.array(ids, dtype=np.int64).reshape(len(score), -1 if ids else 0))
        self._host = None

    def output(self, req: Request, computed) -> StepOutput:
        """After the step (`computed`: what forward_batch returned, model.BatchOutput): fold this request's
        rows in; once its prompt is read, its final output."""
        if self._host is None:   # one copy to the host per step, of the rows asked for only
            self._host = (None if computed.hidden is None else to_numpy(computed.hidden).astype(np.float32),
                          None if computed.scores is None else to_numpy(computed.scores).astype(np.float32))
        hidden, scores = self._host
        at = self.where.get(req.request_id)
        if req.task == "embed" and at is not None:
            req.pooled = pool_chunk(req.pooling, req.pooled, hidden[at])
            req.pooled_upto = max(req.pooled_upto, req.cached_len)
        if req.cached_len < len(req.tokens):
            return StepOutput(req.request_id, [], "")
        req.finish_reason = "stop"
        out = StepOutput(req.request_id, [], "", True, "stop", req.result())
        if req.task == "embed":
            out.embedding = pooled_vector(req.pooling, req.pooled, len(req.tokens))
        else:
            out.scores = scores[at]
        return out
