"""The one loop that drives an engine for a caller: queue a set of requests, step until they finish.

    for out in run(engine, [engine.new_request(prompt, params)], llm._inbox):
        print(out.text, end="")

llm.generate, stream, chat, score, embed and rerank, and `npqwen generate --prompts-file`, are each
this loop and what they keep of its outputs. Several callers may share one engine (two streams of
one LLM): whichever steps it gets every request's outputs, and keeps those of requests that are not
its own in `inbox` (request id -> outputs), where their own loop finds them.
"""


def run(engine, requests: list, inbox: dict | None = None):
    """Yield the StepOutputs of `requests` (made by engine.new_request, new_embedding_request, ...)
    as they come, until every one has finished.

    The requests join the engine when iteration starts, so a loop never iterated costs nothing. When
    the caller stops early (break, close, an error, Ctrl-C) the unfinished ones are aborted and their
    pages freed. Outputs of the engine's other requests go to `inbox`; without one (an engine of the
    caller's own) there are none.
    """
    ids = [req.request_id for req in requests]
    left = set(ids)
    for req in requests:
        engine.add(req)
    try:
        while left:
            # ours that another caller's steps left in the inbox, else one step of the engine
            mine = [out for request_id in ids for out in (inbox.pop(request_id, []) if inbox else [])]
            if not mine:
                for out in engine.step():
                    if out.request_id in left:
                        mine.append(out)
                    elif inbox is not None:
                        inbox.setdefault(out.request_id, []).append(out)
            for out in mine:
                if out.finished:
                    left.discard(out.request_id)
                yield out
    finally:
        for request_id in ids:
            if request_id in left and request_id in engine.requests:
                engine.abort(request_id)
            if inbox:
                inbox.pop(request_id, None)

