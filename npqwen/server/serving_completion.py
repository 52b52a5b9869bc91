"""POST /v1/completions: plain completion of a prompt (text or token ids, one or many), answered
whole or streamed, in the legacy completions shape: echo, logprobs with text offsets, prompt logprobs."""
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from .constraints import format_constraint
from .http import sse
from .protocol import CompletionRequest
from .serving import Choice, Serving, TextOffsets, token_logprobs, usage


class ServingCompletion(Serving):
    """POST /v1/completions."""

    async def complete(self, body: CompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        self.note_ignored(body)
        requests = await self.off_loop(self.completion_requests, body)
        choices = [Choice(i, r) for i, r in enumerate(requests)]
        call = dict(id="cmpl-" + uuid.uuid4().hex, created=int(time.time()), model=self.model_name)
        queue = self.submit(requests)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(self.completion_stream(queue, choices, call, include_usage, body, http),
                       lambda: self.loop.abort(requests))
        if not await self.collect(queue, choices, http):
            return Response(status_code=499)
        leaders = {c.request: c for c in choices if c.request.leader is None}
        answers = []
        for c in choices:
            leader = leaders[c.request.leader or c.request]   # n choices share their prompt's scores
            if body.max_tokens == 0:   # echo alone: the one token the engine drew is not part of the answer
                c.text, c.logprobs, c.token_ids, c.finish_reason = "", [], [], "length"
            answer = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
            if body.echo:
                answer["text"] = self.tokenizer.decode(c.request.prompt_ids) + c.text
                c.logprobs = self.prompt_entries(leader) + c.logprobs
            if body.logprobs is not None:
                answer["logprobs"] = self.completion_logprobs(c.logprobs, c.offsets)
            if body.prompt_logprobs is not None:
                answer["prompt_logprobs"] = self.vllm_prompt_logprobs(leader)
            if body.return_token_ids:
                answer.update(prompt_token_ids=c.request.prompt_ids, token_ids=c.token_ids)
            answers.append(answer)
        return {**call, "object": "text_completion", "choices": answers,
                "usage": usage(requests, generated=body.max_tokens != 0)}

    def completion_requests(self, body: CompletionRequest) -> list:
        """Every prompt's n engine requests, in order; runs off the event loop. Echo with logprobs, and
        prompt_logprobs, make the first choice of each prompt score it; max_tokens 0 (echo alone)
        still draws one token, which the answer leaves out."""
        scored = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        max_tokens, scored = 1 if body.max_tokens == 0 else body.max_tokens, max(scored) if scored else None
        constraint = format_constraint(body)
        return [r for prompt in body.prompts() for r in self.requests(prompt, body, max_tokens, body.logprobs, "prompt",
                                                                     scored, constraint)]

    async def completion_stream(self, queue, choices, call, include_usage: bool, body: CompletionRequest, http):
        prompt_sent = set()   # choices whose first chunk (with prompt_token_ids) is out
        leaders = {c.request: c for c in choices if c.request.leader is None}

        def chunk(c, text: str, finish=None, prompt_logprobs=None):
            choice = {"index": c.index, "text": text, "finish_reason": finish,
                      "logprobs": self.completion_logprobs(c.logprobs, c.offsets) if body.logprobs is not None
                      else None}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
                if c.index not in prompt_sent:
                    choice["prompt_token_ids"] = c.request.prompt_ids
                    prompt_sent.add(c.index)
            c.logprobs, c.token_ids = [], []
            return {**call, "object": "text_completion", "choices": [choice],
                    **({"usage": None} if include_usage else {})}

        async for index, out in self.outputs(queue, [c.request for c in choices], http):
            c = choices[index]
            c.prompt_logprobs += out.prompt_logprobs or []
            if not c.echoed and (out.token_ids or out.finished) and (body.echo or body.prompt_logprobs is not None):
                c.echoed = True   # the prompt has been read (and scored): it goes first
                leader = leaders[c.request.leader or c.request]
                c.logprobs = self.prompt_entries(leader) if body.echo else []
                yield chunk(c, self.tokenizer.decode(c.request.prompt_ids) if body.echo else "",
                            prompt_logprobs=self.vllm_prompt_logprobs(leader)
                            if body.prompt_logprobs is not None else None)
            if body.max_tokens == 0:   # echo alone: the token drawn is not part of the answer
                if out.finished:
                    yield chunk(c, "", "length")
                continue
            c.logprobs += token_logprobs(out)
            c.token_ids += out.token_ids
            if out.text or out.finished:
                yield chunk(c, out.text, out.finish_reason)
        if include_usage:
            yield {**call, "object": "text_completion", "choices": [],
                   "usage": usage([c.request for c in choices], generated=body.max_tokens != 0)}

    def prompt_entries(self, leader: Choice) -> list[tuple]:
        """The prompt's tokens as (token, log p, top) logprobs entries; the first has none (no context)."""
        ids = leader.request.prompt_ids
        return [(ids[0], None, None)] + [(t, lp, top) for t, (lp, top, _) in zip(ids[1:], leader.prompt_logprobs)]

    def completion_logprobs(self, entries, offsets: TextOffsets) -> dict:
        """The legacy completions shape: parallel lists of tokens, their log p, {token: log p} of the
        most likely alternatives and the token drawn (OpenAI's up to logprobs + 1), and each token's
        character offset in the text. Keys are made distinct (token_key)."""
        tops = []
        for token, lp, top in entries:
            if lp is None:   # echo: the prompt's first token has no context
                tops.append(None)
                continue
            keys = {}
            for t, l in [*top, (token, lp)]:
                key = self.token_key(t)
                if keys.get(key, (t,))[0] != t:   # two tokens that read the same: the id tells them apart
                    key = f"token_id:{t}"
                keys.setdefault(key, (t, l))
            tops.append({key: l for key, (_, l) in keys.items()})
        return {"tokens": [self.token_key(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops,
                "text_offset": [offsets.next(self.tokenizer.token_bytes(t)) for t, _, _ in entries]}

    def token_key(self, token: int) -> str:
        """A token's text; one that is a piece of a UTF-8 character (and would print as U+FFFD) is
        written as its bytes, "bytes:\\xe2\\x80", as OpenAI writes such tokens."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
