"""POST /v1/embeddings and /v1/rerank: prefill-only requests through the same engine thread.

    /v1/embeddings  {model, input, encoding_format, dimensions} -> {data: [{index, embedding}], usage}
    /v1/rerank      {model, query, documents, top_n, return_documents}
                    -> {results: [{index, relevance_score, document?}] best first, usage}

Each input (or document) is one engine request that reads its prompt and returns a vector (or the
"no"/"yes" logits): they are packed into steps beside whatever else the server runs. The vectors
are those of llm.embed and the scores those of llm.rerank (npqwen/embed.py, npqwen/rerank.py).
"""
import base64
import functools
import uuid

import numpy as np
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..embed import InputTooLong, check_dimensions, embedding_inputs, finish_vectors
from ..errors import NpqwenError
from ..rerank import scoring_requests, yes_probability
from .protocol import APIError, EmbeddingRequest, RerankRequest
from .serving import Serving

MAX_INPUTS = 2048   # inputs of one /v1/embeddings call, documents of one /v1/rerank call (OpenAI's cap)


def check_count(n: int, param: str):
    if n > MAX_INPUTS:
        raise APIError(400, f"{param} has {n} entries; send at most {MAX_INPUTS} per call", param)


def refused(e: NpqwenError, param: str) -> APIError:
    """A request npqwen cannot run, as a 400 naming the field (too long: context_length_exceeded)."""
    return APIError(400, str(e), param, "context_length_exceeded" if isinstance(e, InputTooLong) else None)


class ServingPooling(Serving):
    """POST /v1/embeddings and /v1/rerank (also at /rerank and /v2/rerank)."""

    async def embeddings(self, body: EmbeddingRequest, http: HTTPRequest):
        self.check_model(body.model, adapters=False)
        llm, engine = self.llm, self.engine
        try:
            width = check_dimensions(body.dimensions, llm.config.hidden_size)
        except NpqwenError as e:
            raise APIError(400, str(e), "dimensions") from None
        try:
            if llm.embedding_config.problem is not None:
                raise NpqwenError(llm.embedding_config.problem)
            inputs = body.inputs()
            check_count(len(inputs), "input")
            # off the event loop, a long text in the tokenizer process (Serving.encode); one too long to
            # embed is refused by its size first
            ids = await self.off_loop(functools.partial(embedding_inputs, llm, inputs, encode=self.encode))
            requests = [engine.new_embedding_request(x, llm.embedding_config.pooling) for x in ids]
        except NpqwenError as e:
            raise refused(e, "input") from None
        outs = await self.finished(requests, http, together=True)   # one piece of work (Serving.submit)
        if outs is None:
            return Response(status_code=499)   # nobody is listening any more
        vectors = finish_vectors(llm.embedding_config, np.stack([o.embedding for o in outs]), width)
        if self.loop.metrics is not None:
            self.loop.metrics.embedding_inputs.inc(len(requests))
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                 if body.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        tokens = sum(len(x) for x in ids)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, body: RerankRequest, http: HTTPRequest):
        self.check_model(body.model, adapters=False)
        documents = body.texts()
        if not documents:
            raise APIError(400, "documents is empty: send at least one", "documents")
        check_count(len(documents), "documents")
        if body.top_n is not None and body.top_n < 1:
            raise APIError(400, f"top_n must be at least 1 (or left out for every document), got {body.top_n}",
                           "top_n")
        try:
            requests = await self.off_loop(scoring_requests, self.llm, self.engine, body.query, documents)
        except NpqwenError as e:
            raise refused(e, "documents") from None
        outs = await self.finished(requests, http, together=True)
        if outs is None:
            return Response(status_code=499)
        scores = yes_probability(np.stack([o.scores for o in outs]))
        if self.loop.metrics is not None:
            self.loop.metrics.rerank_documents.inc(len(requests))
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n]   # stable: ties keep their order
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]
        tokens = sum(len(r.prompt_ids) for r in requests)
        return {"id": "rerank-" + uuid.uuid4().hex, "model": self.model_name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
