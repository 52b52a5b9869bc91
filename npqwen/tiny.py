"""A built-in tiny Qwen3 (`--model tiny`): random weights from a fixed seed, no file, no download.

Same code path as a real checkpoint, with dimensions small enough to print whole arrays:
D=16, H=4, K=2, Dh=8, F=48, 2 layers. Its tokenizer is byte-level (one token per UTF-8
byte) plus Qwen3's special tokens, and it uses Qwen3's chat template. Its weights are
random, so the text it generates is meaningless: it is for stepping through the code.
`--model tiny-moe` is the same with Qwen3-MoE's sparse MLP in both layers: E=8 experts of
width I=24, k=2 per token, renormalised. `--model tiny-qwen3.5` is a Qwen3.5 hybrid: 4 layers, the first
three Gated DeltaNet linear attention (Hk=2 key heads of dk=8, Hv=4 value heads of dv=8, kernel W=4),
the fourth full attention with its output gate (H=4, K=2, Dh=16, 4 of 16 rotated); its norms scale by
1 + weight, so their random weights lie around 0.

Two twins of `tiny` run the embedding and reranking paths offline, as Qwen3-Embedding and
Qwen3-Reranker do (their weights random too, so their vectors and scores are meaningless):
`tiny-embedding` says what Qwen3-Embedding's sentence-transformers files say (last-token pooling,
normalised, a "query" prompt) and its tokenizer appends <|endoftext|>; `tiny-reranker` is a
CrossEncoder whose tokenizer has the "yes" and "no" tokens the reranker's question is answered with.
`--model tiny-qwen4-exp` is a Qwen4-Exp: tiny-qwen3.5's four layers with C=4 hyper-connection streams, QSA on
the full-attention layer and Per-Layer Embeddings on the first.
Which command takes which: embed `tiny-embedding` (any of them embeds), rerank `tiny-reranker`,
every other command `tiny`, `tiny-moe`, `tiny-qwen3.5` or `tiny-qwen4-exp`.
"""
from importlib import resources

import numpy as np

from .backend import array_module
from .chat_format import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN
from .checkpoint import allocate_weights, compact_weights, expected_shapes, tie_lm_head, weights_format
from .config import Qwen3Config
from .model import Qwen3
from .parallel import check_split, shard_shape, shards, take_shards
from .tokenizer import Tokenizer, bytes_to_unicode

# Qwen3's special tokens, in Qwen3's order; (text, special) as in its tokenizer_config.json.
SPECIAL_TOKENS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                  (TOOL_OPEN, False), (TOOL_CLOSE, False), ("<tool_response>", False),
                  ("</tool_response>", False), (THINK_OPEN, False), (THINK_CLOSE, False)]
IM_END, ENDOFTEXT = 256 + 2, 256 + 0

TINY_CONFIG = dict(model_type="qwen3", hidden_size=16, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=256 + len(SPECIAL_TOKENS),
                   max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   tie_word_embeddings=True, bos_token_id=ENDOFTEXT, eos_token_id=IM_END)
TINY_MOE_CONFIG = dict(TINY_CONFIG, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=24, norm_topk_prob=True)
# Qwen3.5 (qwen3_5_text) at the tiny size: layer_types defaults to every fourth layer full attention
TINY_QWEN3_5_CONFIG = dict(TINY_CONFIG, model_type="qwen3_5_text", num_hidden_layers=4, head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=8, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
# Qwen4-Exp (qwen4_exp_text) at the tiny size: tiny-qwen3.5's layers, C=4 streams mixed at rank 8, a QSA layer
# (4 indexer heads of 16, blocks of 4, a budget of 8), PLE on layer 0 (2 + 2 hash heads of 4), 4 experts + a shared one
TINY_QWEN4_EXP_CONFIG = dict(TINY_QWEN3_5_CONFIG, model_type="qwen4_exp_text", hc_count=4, hc_lowrank=8,
                             ple_layer_ids=[1], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
                             ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=16, indexer_n_heads=4,
                             indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16)
# the reranker's answers: whole-word tokens after the special ones (Qwen3's vocabulary has both)
ANSWER_TOKENS = ["yes", "no"]
TINY_RERANKER_CONFIG = dict(TINY_CONFIG, vocab_size=TINY_CONFIG["vocab_size"] + len(ANSWER_TOKENS))
BUILTIN = {"tiny": TINY_CONFIG, "tiny-moe": TINY_MOE_CONFIG,   # --model NAME
           "tiny-embedding": TINY_CONFIG, "tiny-reranker": TINY_RERANKER_CONFIG, "tiny-qwen3.5": TINY_QWEN3_5_CONFIG,
           "tiny-qwen4-exp": TINY_QWEN4_EXP_CONFIG}
# What Qwen3-Embedding's modules.json, 1_Pooling/config.json (pooling_mode_lasttoken), the Normalize
# module and config_sentence_transformers.json ("prompts") say, as npqwen/embed.py reads them.
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
TINY_EMBEDDING = dict(pooling="lasttoken", normalize=True, prompts={"query": QUERY_PROMPT, "document": ""},
                      model_type="SentenceTransformer")
# Qwen3-0.6B's generation_config.json
TINY_GENERATION = dict(temperature=0.6, top_k=20, top_p=0.95, eos_token_id=[IM_END, ENDOFTEXT])
SEED = 0


def qwen3_chat_template() -> str:
    """Qwen3's chat template (from Qwen3's tokenizer_config.json), shipped with npqwen."""
    return resources.files("npqwen").joinpath("qwen3_chat_template.jinja").read_text(encoding="utf-8")


def tiny_tokenizer(name: str = "tiny") -> Tokenizer:
    """Byte-level BPE without merges: token i < 256 is byte i; then Qwen3's special tokens; for
    tiny-reranker "yes" and "no" as whole words; tiny-embedding's appends <|endoftext|> as Qwen3-Embedding's does."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    byte_to_char = bytes_to_unicode()
    backend = Backend(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    for text, special in SPECIAL_TOKENS:   # one at a time, so ids follow the list order
        backend.add_tokens([AddedToken(text, special=special, normalized=False)])
    if name == "tiny-reranker":
        for word in ANSWER_TOKENS:
            backend.add_tokens([AddedToken(word, single_word=True, normalized=False)])
    if name == "tiny-embedding":   # encode(..., add_special_tokens=True) ends with <|endoftext|>
        backend.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A $B <|endoftext|>",
                                                               special_tokens=[("<|endoftext|>", ENDOFTEXT)])
    return Tokenizer(backend, qwen3_chat_template(), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


def tiny_embedding_config(name: str):
    """What the built-in model's sentence-transformers files would say (npqwen/embed.py): the twins' own."""
    from .embed import EmbeddingConfig

    if name == "tiny-embedding":
        return EmbeddingConfig(**TINY_EMBEDDING)
    return EmbeddingConfig(model_type="CrossEncoder") if name == "tiny-reranker" else EmbeddingConfig()


def random_value(name: str, noise: np.ndarray, config: Qwen3Config) -> np.ndarray:
    """A weight from its standard normal noise: std 0.3; a norm's scale 1 + 0.1 noise (Qwen3.5's norms store
    it less 1, except the gated norm); Qwen3.5's decay rates A = exp(A_log) from slow (0.01) to fast (16),
    one per value head (HF's init draws A from (0, 16)), and dt_bias 1, HF's initial value."""
    if name.endswith("A_log"):
        return np.log(np.geomspace(0.01, 16, noise.size))
    if name.endswith("dt_bias"):
        return np.ones(noise.shape)
    if name.endswith("norm.weight") or ".ple.norm_" in name:
        one = 0.0 if config.hybrid and not name.endswith("linear_attn.norm.weight") else 1.0
        return one + 0.1 * noise
    return 0.3 * noise


def tiny_model(device: str = "cpu", dtype: str = "float32", name: str = "tiny", comm=None,
               weights: str = "auto") -> Qwen3:
    """The tiny Qwen3 (or Qwen3-MoE "tiny-moe", Qwen3.5 "tiny-qwen3.5") with its seeded random weights
    (`random_value`); with a tensor-parallel communicator, this rank's part of them. `weights`: a compact
    format ("int8", "bfloat16", ...; npqwen/weights.py) its matrices are converted to."""
    fmt, xp = weights, array_module(device)
    config = Qwen3Config.from_dict(BUILTIN[name], source=f"{name} model")
    weights, fused = allocate_weights(config, xp, np.dtype(dtype))
    rng = np.random.default_rng(SEED)
    for name, array in weights.items():   # checkpoint order, so the values never depend on the device
        array[...] = xp.asarray(random_value(name, rng.standard_normal(array.shape), config))
    parts = None
    if comm is not None and comm.size > 1:   # made whole, then cut: it is tiny
        check_split(config, comm.size)
        shapes = expected_shapes(config)
        parts = shards(config, shapes, comm.size, comm.rank)
    if weights_format(fmt, {}, {}, xp, dtype) not in ("float32", "stored"):   # "auto": float32, it is tiny
        weights, fused = compact_weights(config, weights, fmt, xp, parts)     # converted whole, then cut
    else:
        if parts is not None:
            whole, (weights, fused) = weights, allocate_weights(
                config, xp, np.dtype(dtype), {name: shard_shape(shape, parts[name]) for name, shape in shapes.items()})
            take_shards(whole, parts, weights)
        weights = tie_lm_head(config, weights)
    if config.qwen4_exp:   # its PLE tables, in memory (a checkpoint's stay on disk); its own model class
        from .checkpoint import ple_table_shapes
        from .qwen4_exp import Qwen4Exp
        for name, shape in ple_table_shapes(config).items():
            weights[name] = 0.3 * rng.standard_normal(shape).astype(np.float32)   # (rows, d) on the host
        return Qwen4Exp(config, weights, fused, comm)
    return Qwen3(config, weights, fused, comm)
