"""The model's tokenizer over HTTP, in vLLM's shapes: POST /tokenize (a prompt, or messages through
the chat template), POST /detokenize, and GET /tokenizer_info (lm-evaluation-harness reads it)."""
from ..errors import NpqwenError
from .protocol import APIError, DetokenizeRequest, TokenizeRequest, template_messages
from .serving import Serving
from .tokenizer_process import LONG_TEXT_CHARS


class ServingTokenization(Serving):
    """POST /tokenize, /detokenize (run in a worker thread, Serving.off_loop) and GET /tokenizer_info."""

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            thinking = body.chat_template_kwargs is None or body.chat_template_kwargs.enable_thinking is not False
            messages = template_messages(body.messages)
            try:
                text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, thinking)
            except NpqwenError as e:
                raise APIError(400, str(e), "messages") from None
        else:
            text = body.prompt
        param, context = "messages" if body.messages is not None else "prompt", self.config.max_position_embeddings
        fewest = self.tokenizer.fewest_tokens(text) if len(text) > LONG_TEXT_CHARS else 0
        # as vLLM: add_special_tokens defaults to true for a prompt, false for messages (the template has them)
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        try:
            ids = self.encode(text, special) if fewest <= context else None
        except NpqwenError as e:
            raise APIError(400, str(e), "prompt") from None
        if ids is None or len(ids) > context:   # as vLLM: what could never be a prompt is not counted
            count = f"{len(text)} characters, so at least {fewest}" if ids is None else len(ids)
            raise APIError(400, f"the {param} has {count} tokens, more than this model's context of {context}",
                           param, "context_length_exceeded")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.config.max_position_embeddings}

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info, as vLLM answers it: the tokenizer's configuration, its special tokens
        and chat template (lm-evaluation-harness's remote tokenizer reads it)."""
        return {"tokenizer_class": "npqwen.Tokenizer", **self.tokenizer.special_tokens,
                "chat_template": self.tokenizer.chat_template, "model_max_length": self.config.max_position_embeddings,
                "vocab_size": self.tokenizer.vocab_size}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        self.check_tokens(body.tokens)
        return {"prompt": self.tokenizer.decode(body.tokens)}

