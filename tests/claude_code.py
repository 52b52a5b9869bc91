"""Claude Code against npqwen: its recorded bodies (tests/data/claude_code), the installed client (if
any), and a small checkpoint that holds its prompt and answers "ok" at once.

Claude Code's system prompt and tools are ~77,000 bytes: more than the built-in `tiny` holds (byte-level
tokens, a 4,096 context). The checkpoint written here has tiny's shape (D=16, 2 layers) with Qwen3's own
tokenizer (~20,000 tokens for that prompt) and a 40,960 context, and its weights are set so that it
answers "ok" and ends: its layer's output projections are zero (the residual stream is the token's
embedding), the embedding gives "\n" (the end of the template's "<|im_start|>assistant\n") and "\n\n"
(the end of an empty think block) one direction and "ok" another, and the lm_head maps the first to
"ok" and everything else to <|im_end|>, 40 logits above the rest. Its one layer's attention still
reads the whole prompt (~20 s for Claude Code's on two cores), so the fast tests put `Layerless`,
the same model without the layer that adds zero, inside the engine.
"""
import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np

from npqwen import ops
from npqwen.checkpoint import save_safetensors
from npqwen.model import BatchOutput

DATA = Path(__file__).parent / "data" / "claude_code"
VERSION = "2.1.197"
# telemetry, the auto-updater and every other call home off: the client talks to 127.0.0.1 alone
QUIET = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
         "DISABLE_ERROR_REPORTING": "1", "ANTHROPIC_API_KEY": "dummy"}
# docs/messages.md: a first turn whose prompt takes minutes to read (its stream sends only pings) is given
# 30 minutes, where Claude Code would end it at 5 and resend it unstreamed
PATIENT = {"CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000", "API_TIMEOUT_MS": "1800000"}


def recorded() -> list[dict]:
    """The requests of the recorded sessions: {"session", "method", "path", "headers", "body"}."""
    with gzip.open(DATA / "sessions.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def claude_binary() -> str | None:
    """The Claude Code client: $NPQWEN_CLAUDE, or .cache/claude-code's npm install of VERSION
    (`npm install --prefix .cache/claude-code @anthropic-ai/claude-code@2.1.197`), or `claude` on PATH."""
    root = Path(__file__).resolve().parent.parent
    for candidate in (os.environ.get("NPQWEN_CLAUDE"), root / ".cache/claude-code/node_modules/.bin/claude",
                      shutil.which("claude")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def write_ok_model(path: Path, tokenizer_dir: Path) -> Path:
    """A Qwen3 checkpoint of tiny's shape with Qwen3's tokenizer that answers "ok" (see above)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    newline, blank, ok, im_end = (tokenizer.token_to_id(t) for t in ("Ċ", "ĊĊ", "ok", "<|im_end|>"))
    D, F, H, K, Dh, V = 16, 48, 4, 2, 8, 151936
    config = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=D, intermediate_size=F,
                  num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=K, head_dim=Dh, vocab_size=V,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, bos_token_id=151643, eos_token_id=im_end, torch_dtype="float32")
    embed = np.zeros((V, D), np.float32)
    embed[:, 3] = 1                        # every token: direction 3
    embed[[newline, blank]] = np.eye(D)[0]  # the prompt's end: direction 0
    embed[ok] = np.eye(D)[1]
    head = np.zeros((V, D), np.float32)
    head[ok, 0] = 10                        # after the prompt: "ok"
    head[im_end, 1] = head[im_end, 3] = 10  # after anything else: the end
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": np.ones(D, np.float32)}
    for i in range(1):
        p = f"model.layers.{i}"
        rng = np.random.default_rng(i)
        weights.update({f"{p}.input_layernorm.weight": np.ones(D, np.float32),
                        f"{p}.post_attention_layernorm.weight": np.ones(D, np.float32),
                        f"{p}.self_attn.q_proj.weight": rng.normal(0, 0.1, (H * Dh, D)).astype(np.float32),
                        f"{p}.self_attn.k_proj.weight": rng.normal(0, 0.1, (K * Dh, D)).astype(np.float32),
                        f"{p}.self_attn.v_proj.weight": rng.normal(0, 0.1, (K * Dh, D)).astype(np.float32),
                        f"{p}.self_attn.o_proj.weight": np.zeros((D, H * Dh), np.float32),
                        f"{p}.self_attn.q_norm.weight": np.ones(Dh, np.float32),
                        f"{p}.self_attn.k_norm.weight": np.ones(Dh, np.float32),
                        f"{p}.mlp.gate_proj.weight": rng.normal(0, 0.1, (F, D)).astype(np.float32),
                        f"{p}.mlp.up_proj.weight": rng.normal(0, 0.1, (F, D)).astype(np.float32),
                        f"{p}.mlp.down_proj.weight": np.zeros((D, F), np.float32)})
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(path / "model.safetensors", weights)
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 151643], "temperature": 0.6,
                                                             "top_k": 20, "top_p": 0.95}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


class Layerless:
    """The "ok" model inside the engine without its layer, whose output is zero anyway: embedding, final
    norm and lm_head of the rows that sample, so the same logits in microseconds (no keys are kept)."""

    def __init__(self, real):
        self.config, self.dtype, self.xp, self.weights = real.config, real.dtype, real.xp, real.weights

    def forward_batch(self, batch, kv, recorder=None):
        W = self.weights
        x = W["model.embed_tokens.weight"][np.asarray(batch.token_ids)[np.asarray(batch.sample_rows, int)]]   # (S, D)
        x = ops.rms_norm(x, W["model.norm.weight"], self.config.rms_norm_eps, self.config.norm_offset)
        return BatchOutput(x @ W["lm_head.weight"].T, x[:0])                                           # (S, V)
