"""The web page's probes: POST /v1/npqwen/attention (one position's attention in every head of a
layer), /v1/npqwen/experts (the experts one token went to in each layer of a Qwen3-MoE),
/v1/npqwen/layers (the probability and rank each layer's logit lens gives one token) and
/v1/npqwen/saliency (gradient x input of one token's log-probability for each token before it).
/v1/npqwen/features (an SAE's features on each token of a conversation).

A probe is an engine request like the others: it reads tokens[:position + 1] a chunk per step,
and its last token then runs alone with a recorder that keeps the one array asked for
(Engine._probe_pass), so a probe never holds up the other clients' streams.
"""
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

import numpy as np

from .. import attribution, grad
from ..backend import to_numpy
from ..errors import NpqwenError
from ..hooks import residual_width
from ..lens import token_lens
from ..sampling_params import SamplingParams
from .protocol import (MAX_ATTENTION_TOKENS, MAX_SALIENCY_TOKENS, APIError, AttentionRequest, ExpertsRequest,
                       FeaturesRequest)
from .serving import Serving


class ServingProbes(Serving):
    """POST /v1/npqwen/attention, /v1/npqwen/experts, /v1/npqwen/layers and /v1/npqwen/saliency."""

    async def attention(self, body: AttentionRequest, http: HTTPRequest) -> dict:
        """The attention row of `position` over positions 0 .. position in every head of `layer` (default: the
        first full-attention layer), and their mean: a probe over tokens[:position + 1] (see probe)."""
        self.check_model(body.model, adapters=False)
        ids, layers, heads = body.tokens, self.config.num_hidden_layers, self.config.num_attention_heads
        p = self.position(body)
        full = [i for i in range(layers) if not self.config.is_linear_layer(i)]   # Qwen3: all of them
        if not full:
            raise APIError(400, "every layer of this model is Gated DeltaNet linear attention: it reads a fixed-size "
                                "state, not the positions, so there are no attention weights to show", "layer")
        layer = full[0] if body.layer is None else body.layer
        if not 0 <= layer < layers:
            raise APIError(400, f"layer {layer} does not exist: the model has layers 0 .. {layers - 1}", "layer")
        if self.config.is_linear_layer(layer):   # Qwen3.5 / Qwen3-Next: a state matrix, no weights over positions
            raise APIError(400, f"layer {layer} is a Gated DeltaNet linear-attention layer: it reads a fixed-size "
                                f"state, not the positions, so it has no attention weights to show; the "
                                f"full-attention layers are {full}", "layer")
        name, kept = f"model.layers.{layer}.self_attn.attn_probs", {}

        def keep(step, array):   # the probe's last token: (H, 1, p + 1) -> (H, p + 1)
            if step == name:
                kept["rows"] = to_numpy(array)[:, 0]

        if not await self.probe(ids[:p + 1], keep, http):
            return Response(status_code=499)
        rows = kept["rows"].astype("float64")                                          # (H, p + 1)
        decode = self.tokenizer.decode
        return {"object": "npqwen.attention", "model": self.model_name, "layer": layer, "position": p,
                "num_layers": layers, "num_heads": heads, "attention_layers": full,
                "tokens": [decode([t]) for t in ids[:p + 1]],
                "token_bytes": [list(self.tokenizer.token_bytes(t)) for t in ids[:p + 1]],   # as logprobs' "bytes"
                "heads": rows.tolist(), "mean": rows.mean(axis=0).tolist()}

    async def experts(self, body: ExpertsRequest, http: HTTPRequest) -> dict:
        """Qwen3-MoE: the experts the router sent token `position` to in each layer, best first, with their
        weights; a probe over tokens[:position + 1] (see probe). A dense model has none: num_experts 0 and
        no layers, answered without a pass."""
        self.check_model(body.model, adapters=False)
        ids, cfg = body.tokens, self.config
        p = self.position(body)
        answer = {"object": "npqwen.experts", "model": self.model_name, "position": p,
                  "token": self.tokenizer.decode([ids[p]]), "num_experts": cfg.num_experts,
                  "num_experts_per_tok": cfg.num_experts_per_tok, "layers": []}
        if not cfg.num_experts:
            return answer
        kept = {}

        def keep(step, array):   # position p is the probe's last token: the one row of the router's choices
            if step.endswith((".mlp.gate.top_k_index", ".mlp.gate.top_k_weights")):
                kept[step] = to_numpy(array)[0].tolist()

        if not await self.probe(ids[:p + 1], keep, http):
            return Response(status_code=499)
        for i in range(cfg.num_hidden_layers):
            gate = f"model.layers.{i}.mlp.gate"
            answer["layers"].append({"layer": i, "experts": kept.get(f"{gate}.top_k_index"),    # None: dense
                                     "weights": kept.get(f"{gate}.top_k_weights")})
        return answer

    async def layers(self, body: ExpertsRequest, http: HTTPRequest) -> dict:
        """The token at `position` under each layer's logit lens, read where it was predicted (position - 1):
        its probability and rank per layer; a probe over tokens[:position] (see probe). The lens itself, L
        rows of lm_head's product, runs in a worker thread, not on the engine's."""
        self.check_model(body.model)
        ids, L = body.tokens, self.config.num_hidden_layers
        p = self.position(body)
        if p == 0:
            raise APIError(400, "position 0 is not predicted by any position before it; choose 1 .. "
                                f"{len(ids) - 1}", "position")
        blocks = {f"model.layers.{i}": i for i in range(L)}
        kept = np.zeros((L, residual_width(self.config)), np.float32)                # (L, D); Qwen4-Exp (L, C*D)

        def keep(step, array):   # position p - 1 is the probe's last token: its row of each block's output
            if step in blocks:
                kept[blocks[step]] = to_numpy(array)[-1]

        if not await self.probe(ids[:p], keep, http):
            return Response(status_code=499)
        probs, ranks = await self.off_loop(token_lens, self.llm, kept, ids[p])
        return {"object": "npqwen.layers", "model": self.model_name, "position": p,
                "token": self.tokenizer.decode([ids[p]]),
                "layers": [{"layer": i, "probability": float(probs[i]), "rank": int(ranks[i])} for i in range(L)]}

    async def saliency(self, body: ExpertsRequest, http: HTTPRequest) -> dict:
        """Which earlier tokens the token at `position` leaned on: gradient x input of log p(token) at position - 1,
        per token of tokens[:position] (npqwen.attribution.gradient_x_input: grad . embedding over D). Not a
        probe: one forward and one backward over tokens[:position], run on the engine thread between two of its
        steps (one thread owns the model), so the streams wait for it (the tiny model: milliseconds)."""
        self.check_model(body.model, adapters=False)
        ids = body.tokens
        p = self.position(body)
        if p == 0:
            raise APIError(400, "position 0 is not predicted by any position before it; choose 1 .. "
                                f"{len(ids) - 1}", "position")
        if p > MAX_SALIENCY_TOKENS:
            raise APIError(400, f"saliency takes a backward pass over the {p} tokens before position {p}; it is "
                                f"offered for up to {MAX_SALIENCY_TOKENS}", "position")

        def gradient_x_input():   # on the engine thread
            return attribution.gradient_x_input(self.llm, ids[:p], grad.log_prob(ids[p]))

        try:
            s = await self.loop.call(gradient_x_input)
        except NpqwenError as e:   # a model the gradients do not cover (tensor parallelism)
            raise APIError(400, f"no saliency for this model: {e}", "model") from None
        decode = self.tokenizer.decode
        return {"object": "npqwen.saliency", "model": self.model_name, "position": p, "token": decode([ids[p]]),
                "log_prob": float(s.value), "tokens": [decode([t]) for t in ids[:p]],
                "token_bytes": [list(self.tokenizer.token_bytes(t)) for t in ids[:p]],
                "scores": s.per_token.tolist()}

    async def features(self, body: FeaturesRequest, http: HTTPRequest) -> dict:
        """An SAE (--sae NAME) over every token of `tokens`: token `position`'s strongest features, and each of
        those features' activation on every token (where it fires). Unlike the probes above it needs every
        position's activation, so llm.run_with_saes runs whole on the engine thread, between two steps (one
        forward pass of up to 2048 tokens: the streams wait that long). No SAE loaded: "saes" is empty."""
        self.check_model(body.model, adapters=False)
        answer = {"object": "npqwen.features", "model": self.model_name, "saes": list(self.saes)}
        if not self.saes:
            return answer
        name = next(iter(self.saes)) if body.sae is None else body.sae
        if name not in self.saes:
            raise APIError(400, f"sae {name!r} is not one this server loaded; it has {', '.join(self.saes)}", "sae")
        ids, sae, labels = body.tokens, self.saes[name], self.labels.get(name, {})
        p = self.position(body)
        _, (run,) = await self.loop.call(lambda: self.llm.run_with_saes(ids, [sae], top=body.top))
        top = [(int(f), float(a)) for f, a in zip(run.indices[p], run.values[p]) if a > 0]   # strongest first
        decode = self.tokenizer.decode
        return {**answer, "sae": name, "kind": sae.kind, "reads": sae.reads, "num_features": sae.width,
                "position": p, "tokens": [decode([t]) for t in ids],
                "token_bytes": [list(self.tokenizer.token_bytes(t)) for t in ids],
                "features": [{"feature": f, "activation": a, "label": labels.get(f),
                              "activations": run.acts[:, f].astype("float64").tolist()} for f, a in top]}

    def position(self, body: AttentionRequest | ExpertsRequest | FeaturesRequest) -> int:
        """The position a probe looks at (default: the last token), after checking the tokens it reruns."""
        ids = body.tokens
        limit = min(MAX_ATTENTION_TOKENS, self.config.max_position_embeddings)
        if not 1 <= len(ids) <= limit:
            raise APIError(400, f"tokens has {len(ids)} ids; send 1 .. {limit} (a longer conversation is not "
                                f"probed)", "tokens")
        self.check_tokens(ids)
        p = len(ids) - 1 if body.position is None else body.position
        if not 0 <= p < len(ids):
            raise APIError(400, f"position {p} is not a position of the {len(ids)} tokens (0 .. {len(ids) - 1})",
                           "position")
        return p

    async def probe(self, ids: list[int], recorder, http: HTTPRequest) -> bool:
        """An engine request that reads `ids` a chunk per step, like any prompt, and whose last token
        then runs alone with `recorder` (Engine._probe_pass); False if the client went away first."""
        req = self.engine_request(ids, SamplingParams(max_new_tokens=1, temperature=0), "tokens")
        req.probe = recorder
        return await self.finished([req], http) is not None
