"""Embeddings and rerank scores: golden tests against sentence-transformers, transformers' AutoModel (the
Qwen3-Embedding model card's code) and the Qwen3-Reranker model card's code, on random-weight checkpoints
built with those libraries' own classes and the real Qwen3 tokenizer; and the engine's prefill-only requests."""
import json
import shutil

import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError
from npqwen import ops

from conftest import EMBEDDING_SMALL, QWEN3_EMBEDDING_0_6B, QWEN3_TOKENIZER_DIR, build_embedding_checkpoint
from tolerance import logprob_tolerance, model_tolerance, relative_diff, rounding_tolerance, tolerance_of

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

SMALL = EMBEDDING_SMALL
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PASSAGE = ("The capital of China is Beijing. Gravity is a force that attracts two bodies towards each other. "
           "It gives weight to physical objects and is responsible for the movement of planets around the sun. "
           "北京是中国的首都。 NumPy arrays hold numbers of one dtype; 🙂 emoji take several bytes. ")


def texts_of_lengths(lengths) -> list[str]:
    """Texts whose token counts (with <|endoftext|>) are about `lengths`: cuts of a long passage."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(QWEN3_TOKENIZER_DIR / "tokenizer.json"))
    ids = tokenizer.encode(PASSAGE * 40, add_special_tokens=False).ids
    return [tokenizer.decode(ids[7 * i:7 * i + n - 1]) for i, n in enumerate(lengths)]


MIXED = [1, 2, 9, 33, 100, 257, 600]       # token counts in one call: an empty text is its <|endoftext|> alone


def compare(got: np.ndarray, want: np.ndarray, what: str, config: dict = SMALL, tokens: int = max(MIXED)):
    """Row cosines and max |diff| of two (n, d) float32 arrays of unit rows (or near it); prints and asserts the
    float32 bar of a forward pass of `config` over at most `tokens` tokens (tests/tolerance.py): every value
    within it, so each row's 1 - cosine = |got - want|^2 / 2 within d times its square over 2."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    diff = np.abs(got - want)
    worst = int(diff.max(axis=1).argmax())
    tolerance = model_tolerance(npqwen.Qwen3Config.from_dict(config), tokens)
    report = (f"{what}: min cosine 1 - {1 - cos.min():.2e}, max |diff| {diff.max():.2e} (row {worst}; tolerance "
              f"{tolerance:.1e})")
    print(report)
    assert cos.min() >= 1 - got.shape[1] * tolerance ** 2 / 2 and diff.max() <= tolerance, report


def st_model(path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), model_kwargs={"dtype": torch.float32})


@pytest.fixture(scope="module")
def hub_dir(embedding_small):
    return embedding_small


@pytest.fixture(scope="module")
def hub(hub_dir):
    return npqwen.load(hub_dir)


# -- loading ----------------------------------------------------------------------------------------------------


def test_loads_a_qwen3model_checkpoint_as_its_files_spell_it(hub_dir, hub):
    header = json.loads((hub_dir / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (hub_dir / "model.safetensors").read_bytes()[:8], "little")])
    stored = set(header) - {"__metadata__"}
    assert "embed_tokens.weight" in stored and "lm_head.weight" not in stored   # saved from Qwen3Model
    assert set(hub.weights) == stored                                             # llm.weights: as stored
    q = "layers.0.self_attn.q_proj.weight"
    assert hub.weights[q] is hub.model.weights[f"model.{q}"]
    assert hub.config.vocab_size == 151669 and hub.kind == "embedding"
    c = hub.embedding_config
    assert (c.pooling, c.normalize, c.prompts["query"], c.max_seq_length, c.chat_template) == \
           ("lasttoken", True, "Instruct: " + INSTRUCTION + "\nQuery:", 8192, None)


def test_a_model_prefix_and_the_current_format_load_too(tmp_path, hub_dir, hub):
    """The same weights with HF's "model." names and sentence-transformers 6's files embed the same."""
    from npqwen.checkpoint import index_checkpoint, read_tensor, save_safetensors

    prefixed = tmp_path / "prefixed"
    shutil.copytree(hub_dir, prefixed)
    tensors = {}
    for name, info in index_checkpoint(hub_dir).items():
        out = np.empty(info.shape, np.float32)
        read_tensor(info, out)
        tensors[f"model.{name}"] = out
    save_safetensors(prefixed / "model.safetensors", tensors)
    llm = npqwen.load(prefixed)
    assert "model.embed_tokens.weight" in llm.weights and "lm_head.weight" in llm.weights   # tied, as HF names it
    texts = texts_of_lengths([5, 40])
    np.testing.assert_array_equal(llm.embed(texts), hub.embed(texts))


def test_an_untied_checkpoint_without_lm_head_embeds_but_does_not_generate(tmp_path):
    path = build_embedding_checkpoint(tmp_path, {**SMALL, "tie_word_embeddings": False}, layout="hub")
    llm = npqwen.load(path)
    assert "lm_head.weight" not in llm.model.weights and llm.kind == "embedding"
    compare(llm.embed(texts_of_lengths([3, 30])), st_model(path).encode(texts_of_lengths([3, 30])), "untied")
    for call in (lambda: llm.generate("hi", max_new_tokens=2), lambda: llm.rerank("q", ["d"]),
                 lambda: llm.forward([1, 2])):
        with pytest.raises(NpqwenError, match="no lm_head .* Qwen3Model"):
            call()


# -- golden: sentence-transformers, AutoModel --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["hub", "current", "current-text"])
def test_embed_equals_sentence_transformers(layout, tmp_path, hub_dir):
    """Documents and queries, 1 to 600 tokens in one call, and Matryoshka dimensions, in both file formats
    ("current" with the message modality that sentence-transformers 6 adds for a tokenizer with a chat template)."""
    path = hub_dir if layout == "hub" else build_embedding_checkpoint(tmp_path, SMALL, layout=layout)
    llm, st = npqwen.load(path), st_model(path)
    texts = texts_of_lengths(MIXED)
    if layout == "hub":
        lengths = [len(ids) for ids in npqwen.embed.embedding_inputs(llm, texts)]
        assert min(lengths) == 1 and max(lengths) >= 595, lengths
    compare(llm.embed(texts), st.encode(texts), f"{layout} documents")
    compare(llm.embed(texts[:4], prompt_name="query"), st.encode(texts[:4], prompt_name="query"), f"{layout} queries")
    compare(llm.embed(texts[:4], instruction=INSTRUCTION), st.encode(texts[:4], prompt_name="query"),
            f"{layout} instruction")
    compare(llm.embed(texts, dimensions=32), st.encode(texts, truncate_dim=32, normalize_embeddings=True),
            f"{layout} dimensions=32")


def test_embed_equals_the_model_cards_transformers_code(hub_dir, hub):
    """Qwen3-Embedding's model card: AutoModel, left padding, the last position's state, normalised."""
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hub_dir, padding_side="left")
    model = AutoModel.from_pretrained(hub_dir, dtype=torch.float32).eval()
    texts = [f"Instruct: {INSTRUCTION}\nQuery:{t}" for t in texts_of_lengths([4, 20])] + texts_of_lengths([60, 200])
    batch = tokenizer(texts, padding=True, truncation=True, max_length=8192, return_tensors="pt")
    with torch.no_grad():
        last = model(**batch).last_hidden_state[:, -1]      # left padding: the last column is every text's last token
    want = F.normalize(last, p=2, dim=1).numpy()
    compare(hub.embed(texts), want, "AutoModel, left padding")
    queries = hub.embed(texts_of_lengths([4, 20]), instruction=INSTRUCTION)
    compare(queries, want[:2], "instruction= vs the card's get_detailed_instruct")


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_mean_and_cls_pooling_equal_sentence_transformers(pooling, tmp_path):
    path = build_embedding_checkpoint(tmp_path, SMALL, layout="hub", pooling=pooling)
    llm = npqwen.load(path)
    texts = texts_of_lengths([1, 7, 300, 40])
    engine = Engine(llm, kv_cache_tokens=4096, page_size=16, max_batched_tokens=64)   # long texts in chunks
    llm._engine = engine
    compare(llm.embed(texts), st_model(path).encode(texts), f"{pooling} pooling, chunked")
    assert engine.pool.num_pages == len(engine.pool.free) + engine.cache.cached_pages


def test_any_qwen3_checkpoint_embeds_with_its_last_token(tiny_full_vocab):
    """A plain Qwen3 checkpoint (no sentence-transformers files): the final norm's last-token state, unnormalised."""
    from conftest import hf_model

    llm, ids = npqwen.load(tiny_full_vocab), [[5, 9, 200], list(range(40, 90))]
    assert llm.kind == "generation" and llm.embedding_config.pooling == "lasttoken"
    with torch.no_grad():
        want = [hf_model(tiny_full_vocab).model(torch.tensor([x])).last_hidden_state[0, -1].numpy() for x in ids]
    compare(llm.embed(ids), np.stack(want), "Qwen3ForCausalLM's final-norm last token")


def test_exact_qwen3_embedding_0_6b_shape(tmp_path):
    """The Qwen3-Embedding-0.6B shape (28 layers, D=1024, vocab 151669), hub layout, float32, vs
    sentence-transformers."""
    path = build_embedding_checkpoint(tmp_path, QWEN3_EMBEDDING_0_6B, layout="hub", std=0.02, save_dtype="bfloat16")
    texts = texts_of_lengths([1, 6, 50, 600])
    llm = npqwen.load(path)
    got = [llm.embed(texts), llm.embed(texts[1:3], instruction=INSTRUCTION), llm.embed(texts[:3], dimensions=128)]
    del llm
    st = st_model(path)
    compare(got[0], st.encode(texts), "0.6B documents", QWEN3_EMBEDDING_0_6B)
    compare(got[1], st.encode(texts[1:3], prompt_name="query"), "0.6B queries", QWEN3_EMBEDDING_0_6B)
    compare(got[2], st.encode(texts[:3], truncate_dim=128, normalize_embeddings=True), "0.6B dimensions=128",
            QWEN3_EMBEDDING_0_6B)


# -- the engine's prefill-only requests --------------------------------------------------------------------------


class BatchSpy:
    """Wraps forward_batch: keeps each step's batch, and checks that lm_head never multiplies the vocabulary."""

    def __init__(self, model, monkeypatch):
        self.batches, real, vocab = [], model.forward_batch, model.config.vocab_size

        def forward_batch(batch, kv, recorder=None):
            self.batches.append(batch)
            return real(batch, kv)

        def linear(x, weight):
            assert weight.shape[0] != vocab, "a product over the whole vocabulary"
            return real_linear(x, weight)
        real_linear = ops.linear
        monkeypatch.setattr(model, "forward_batch", forward_batch)
        monkeypatch.setattr(ops, "linear", linear)


def test_prefill_only_requests_pack_chunk_and_free_their_pages(hub, monkeypatch):
    engine = Engine(hub, kv_cache_tokens=2048, page_size=16, max_batched_tokens=96)
    spy = BatchSpy(hub.model, monkeypatch)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 151643, n).tolist() for n in (3, 5, 200, 8)]
    alone = [Engine(hub, kv_cache_tokens=2048, page_size=16, max_batched_tokens=512) for _ in ids]
    requests = [engine.new_embedding_request(x) for x in ids]
    outs = hub.run_prefill_only(requests, engine)
    first = spy.batches[0]
    assert first.lengths[:2] == [3, 5] and len(first.token_ids) == sum(first.lengths) == 96   # packed, no padding
    assert len(first.sample_rows) == 0 and len(first.score_rows) == 0
    assert first.hidden_rows.tolist() == [2, 7]        # only the last rows of the texts that end in this step
    assert any(b.starts[0] > 0 for b in spy.batches)   # the long text went in chunks
    assert engine.pool.num_pages == len(engine.pool.free) + engine.cache.cached_pages and not engine.requests
    engine.check()
    for x, out, e in zip(ids, outs, alone):            # its company and its chunks do not change a vector
        single = hub.run_prefill_only([e.new_embedding_request(x)], e)[0].embedding
        # in company and in chunks against alone: the same sums, blocked otherwise
        assert out.finished and out.token_ids == [] and relative_diff(out.embedding, single) <= tolerance_of(hub, len(x))


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_a_preempted_prefill_only_request_ends_as_an_uninterrupted_one(hub, pooling):
    """A 200-token text read beside a generating request in a pool too small for both at their longest: the
    text (admitted last) is preempted and read again; its vector equals an uninterrupted one (mean pooling
    folds no position twice)."""
    text = list(range(1000, 1200))
    roomy = Engine(hub, kv_cache_tokens=1024, page_size=16)
    (want,) = hub.run_prefill_only([roomy.new_embedding_request(text, pooling)], roomy)
    tight = Engine(hub, kv_cache_tokens=14 * 16, page_size=16, max_batched_tokens=32)   # the text alone needs 13
    rid = tight.add_request(list(range(16)), max_new_tokens=60, temperature=0)
    tight.requests[rid].eos_ids = frozenset()                                            # it grows to 5 pages
    (got,) = hub.run_prefill_only([tight.new_embedding_request(text, pooling)], tight)
    while tight.has_unfinished():
        tight.step()
    assert tight.stats["preemptions"] > 0
    assert relative_diff(got.embedding, want.embedding) <= tolerance_of(hub, len(text))   # read again, in other chunks
    tight.check()


def test_prefill_only_requests_ride_beside_generation(hub_dir):
    """A generating request and embeddings in the same steps: the tokens are those of the request alone."""
    llm = npqwen.load(hub_dir)   # tied: its lm_head is the embedding, so it can also generate
    alone = llm.generate([5, 6, 7], max_new_tokens=6, temperature=0).token_ids
    engine = Engine(llm, kv_cache_tokens=2048, page_size=16, max_batched_tokens=64)
    rid = engine.add_request([5, 6, 7], max_new_tokens=6, temperature=0)
    embeds = [engine.add(engine.new_embedding_request(x)) for x in ([9] * 100, [10, 11])]
    tokens, vectors = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids if out.request_id == rid else []
            if out.embedding is not None:
                vectors[out.request_id] = out.embedding
        engine.check()
    assert tokens == alone and set(vectors) == set(embeds)


def test_embed_errors(hub):
    for call, match in [(lambda: hub.embed([]), "non-empty list"),
                        (lambda: hub.embed(["a"], dimensions=0), "dimensions must be an integer from 1 to 64"),
                        (lambda: hub.embed(["a"], dimensions=65), "from 1 to 64"),
                        (lambda: hub.embed(["a"], prompt_name="passage"), "'passage' is not one of .*'query'"),
                        (lambda: hub.embed(["a"], instruction="x", prompt_name="query"), "not both"),
                        (lambda: hub.embed([[1, 2]], instruction="x"), "token ids, which take no prompt"),
                        (lambda: hub.embed([[1, 999999]]), "outside the vocabulary"),
                        (lambda: hub.embed(["a", 3]), "input 1 is int"),
                        (lambda: hub.embed(["word " * 9000]), r"input 0 has 900\d tokens, .* at most 2048"),
                        (lambda: hub.embed(["a"], normalize="yes"), "normalize must be")]:
        with pytest.raises(NpqwenError, match=match):
            call()
    assert not hub.engine.requests


def test_sentence_transformers_files_npqwen_cannot_follow_are_a_clear_error_when_embedding(tmp_path, hub_dir):
    path = tmp_path / "max"
    shutil.copytree(hub_dir, path)
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_lasttoken": False,
                                                                "pooling_mode_max_tokens": True}))
    llm = npqwen.load(path)   # loading (and generating) still works
    with pytest.raises(NpqwenError, match="pooling mode 'max' is not one npqwen computes"):
        llm.embed(["a"])
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                              "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(NpqwenError, match="a Dense module .* npqwen runs Transformer, Pooling, Normalize only"):
        npqwen.load(path).embed(["a"])


# -- rerank --------------------------------------------------------------------------------------------------------


def model_card_rerank(path, query, documents, instruction=INSTRUCTION):
    """Qwen3-Reranker's model card, transformers usage (max_length 8192, left padding), on `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    token_false_id, token_true_id = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    max_length = 8192
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prefix_tokens = tokenizer.encode(prefix, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(suffix, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}" for doc in documents]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix_tokens) - len(suffix_tokens))
    for i, ele in enumerate(inputs["input_ids"]):
        inputs["input_ids"][i] = prefix_tokens + ele + suffix_tokens
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)
    with torch.no_grad():
        batch_scores = model(**inputs).logits[:, -1, :]
    scores = torch.stack([batch_scores[:, token_false_id], batch_scores[:, token_true_id]], dim=1)
    return torch.nn.functional.log_softmax(scores, dim=1)[:, 1].exp().numpy()


@pytest.fixture(scope="module")
def reranker_dir(reranker_small):
    return reranker_small


def rerank_tolerance(llm, tokens: int = 200) -> float:
    """A score is sigmoid(logit yes - logit no), whose slope is at most 1/4: a quarter of the two logits' float32
    bar (|logits| at most 8 on these random checkpoints), over the longest prompt here (about 200 tokens)."""
    return logprob_tolerance(llm.config, tokens, 8.0) / 4


def test_rerank_equals_the_model_cards_transformers_code(reranker_dir):
    query = "What is the capital of China?"
    documents = texts_of_lengths([2, 20, 90, 35])
    want = model_card_rerank(reranker_dir, query, documents)
    llm = npqwen.load(reranker_dir)
    got = llm.rerank(query, documents)
    diff, tolerance = np.abs(got - want).max(), rerank_tolerance(llm)
    print(f"rerank: max |diff| {diff:.2e} (tolerance {tolerance:.1e}); scores {np.round(got, 4).tolist()}")
    assert got.shape == (4,) and ((0 <= got) & (got <= 1)).all() and got.std() > 100 * tolerance   # documents differ
    assert diff <= tolerance
    other = llm.rerank(query, documents, instruction="Judge by the first word")
    want = model_card_rerank(reranker_dir, query, documents, "Judge by the first word")
    assert np.abs(other - want).max() <= tolerance


def test_rerank_documents_share_the_query_prefix_through_the_prefix_cache(reranker_dir, monkeypatch):
    llm = npqwen.load(reranker_dir)
    query, documents = " ".join(["a long question about Beijing"] * 12), texts_of_lengths([30, 12, 50])
    want = model_card_rerank(reranker_dir, query, documents)
    engine = Engine(llm, kv_cache_tokens=2048, page_size=16)
    llm._engine, spy = engine, BatchSpy(llm.model, monkeypatch)
    got = llm.rerank(query, documents)
    assert np.abs(got - want).max() <= rerank_tolerance(llm)
    prompts = [npqwen.rerank.prompt_ids(llm.tokenizer, INSTRUCTION, query, d) for d in documents]
    shared = [npqwen.rerank.common_prefix(prompts[0], p) // 16 * 16 for p in prompts[1:]]
    assert engine.cache.hit_tokens == sum(shared) and min(shared) >= 96   # the 2nd and 3rd read the 1st's pages
    assert [len(b.score_rows) for b in spy.batches] == [1, 2] and len(spy.batches[0].sample_rows) == 0
    assert spy.batches[1].score_ids.tolist() == [list(npqwen.rerank.no_yes_ids(llm))] * 2


def test_rerank_errors(reranker_dir):
    llm = npqwen.load(reranker_dir)
    for call, match in [(lambda: llm.rerank("q", []), "non-empty list"), (lambda: llm.rerank("q", "doc"), "list"),
                        (lambda: llm.rerank(3, ["d"]), "query must be a string"),
                        (lambda: llm.rerank("q", ["d", None]), r"documents\[1\] is NoneType"),
                        (lambda: llm.rerank("q", ["x " * 3000]), r"documents\[0\]: the prompt has \d+ tokens")]:
        with pytest.raises(NpqwenError, match=match):
            call()


# -- the built-in twins: tiny-embedding and tiny-reranker run both paths offline --

def test_tiny_embedding_pools_its_last_token_and_normalises_as_its_files_say():
    from npqwen.tiny import ENDOFTEXT, QUERY_PROMPT

    twin, tiny = npqwen.load("tiny-embedding"), npqwen.load("tiny")   # the same random weights
    assert twin.kind == "embedding" and twin.tokenizer.encode("hi", add_special_tokens=True)[-1] == ENDOFTEXT
    ids = tiny.tokenizer.encode(QUERY_PROMPT + "hi") + [ENDOFTEXT]
    want = tiny.embed([ids], normalize=True)                           # last token, unit length
    compare(twin.embed("hi", prompt_name="query"), want, "tiny-embedding query")
    compare(twin.embed("hi", instruction=INSTRUCTION), want, "tiny-embedding instruction")
    # float32: a sum of D squares, its square root, a division
    assert np.allclose(np.linalg.norm(twin.embed(["a", "b c"]), axis=1), 1, atol=rounding_tolerance(twin.config.hidden_size, 2))


def test_tiny_reranker_scores_p_yes_against_no():
    from npqwen.rerank import DEFAULT_INSTRUCTION, prompt_ids

    twin = npqwen.load("tiny-reranker")
    yes, no = twin.tokenizer.token_to_id("yes"), twin.tokenizer.token_to_id("no")
    assert twin.kind == "reranker" and None not in (yes, no)
    assert twin.tokenizer.encode("no know") == [no, 32, *b"know"]   # whole words only
    scores = twin.rerank("q", ["a doc", "another"])
    for doc, score in zip(["a doc", "another"], scores):
        logits = np.asarray(twin.forward(prompt_ids(twin.tokenizer, DEFAULT_INSTRUCTION, "q", doc)))[-1]
        # the engine's scoring pass against one forward: a sigmoid of the two logits' difference, its slope <= 1/4
        tokens = len(prompt_ids(twin.tokenizer, DEFAULT_INSTRUCTION, "q", doc))
        assert abs(score - 1 / (1 + np.exp(logits[no] - logits[yes]))) <= logprob_tolerance(twin.config, tokens, logits) / 4
    with pytest.raises(NpqwenError, match="tiny-reranker is a built-in one"):
        npqwen.load("tiny").rerank("q", ["d"])
