"""The OpenAI-compatible server: HTTP and OpenAI shapes on one side, the engine on the other."""
