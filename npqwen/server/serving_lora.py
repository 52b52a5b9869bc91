"""LoRA adapters at run time, in vLLM's shapes: POST /v1/load_lora_adapter, /v1/unload_lora_adapter.

Only with `npqwen serve --allow-runtime-lora`: the path is a directory on the server's disk, so a
client that may call these reads any adapter-shaped directory the server can read (and fills its
memory with them). A loaded adapter is then a model name like the base's: a request whose `model`
names it runs through it (Serving.lora_of), /v1/models lists it with the base as its parent.
"""
from fastapi.responses import PlainTextResponse

from ..errors import NpqwenError
from .protocol import APIError, LoraAdapterRequest
from .serving import Serving


class ServingLora(Serving):
    """Loading (in a worker thread: it reads files) and unloading adapters; running requests keep theirs."""

    def __init__(self, allow_runtime_lora: bool = False, **shared):
        super().__init__(**shared)
        self.allowed = allow_runtime_lora

    def check_allowed(self):
        if not self.allowed:
            raise APIError(404, "loading LoRA adapters at run time is off on this server: start it with "
                                "--allow-runtime-lora (or load adapters at start with --lora name=path)",
                           None, "not_found")

    async def load(self, body: LoraAdapterRequest) -> PlainTextResponse:
        self.check_allowed()
        if body.lora_path is None:
            raise APIError(400, "lora_path is missing: the adapter's directory on the server's disk", "lora_path")
        if body.lora_name == self.model_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name; give the adapter another",
                           "lora_name")
        try:
            await self.off_loop(self.llm.load_lora, body.lora_name, body.lora_path)
        except NpqwenError as e:
            raise APIError(400, str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    def unload(self, body: LoraAdapterRequest) -> PlainTextResponse:
        self.check_allowed()
        if body.lora_name not in self.llm.loras:
            raise APIError(404, f"no LoRA adapter {body.lora_name!r} is loaded (loaded: "
                                f"{', '.join(self.llm.loras) or 'none'})", "lora_name", "model_not_found")
        self.llm.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
