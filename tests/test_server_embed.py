"""`/v1/embeddings` through the official openai client and `/v1/rerank` by raw HTTP: equal to llm.embed and
llm.rerank, in OpenAI's (and the rerank APIs') shapes, every refusal a 400 that names the field."""
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("sentence_transformers")

import npqwen  # noqa: E402

from serving import LiveServer, http_json  # noqa: E402
from conftest import EMBEDDING_SMALL  # noqa: E402
from npqwen import Qwen3Config  # noqa: E402
from tolerance import logprob_tolerance, rounding_tolerance  # noqa: E402

TEXTS = ["The capital of China is Beijing.", "", "Gravity is a force that attracts two bodies towards each other. " * 9]


def served(path, name):
    """A live server of the checkpoint, and an LLM of its own to compare with."""
    server = LiveServer(npqwen.load(path), model_name=name)
    yield server, npqwen.load(path)
    server.close()


@pytest.fixture(scope="module")
def embedding(embedding_small):
    yield from served(embedding_small, "emb")


@pytest.fixture(scope="module")
def reranker(reranker_small):
    yield from served(reranker_small, "rr")


def close(got, want):
    """The server's engine batches the texts (and scores) otherwise than the LLM's: the same sums, blocked
    otherwise, so within the small models' float32 bar over these texts (under 64 tokens; embeddings at most 1,
    scores a sigmoid of logits at most 8 (measured: 5), its slope at most 1/4)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    bound = logprob_tolerance(Qwen3Config.from_dict(EMBEDDING_SMALL), 64, 8.0)
    assert got.shape == want.shape and np.abs(got - want).max() <= bound, np.abs(got - want).max()


def test_embeddings_through_the_openai_client_equal_llm_embed(embedding):
    server, llm = embedding
    client = server.client()
    r = client.embeddings.create(model="emb", input=TEXTS)          # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
    close([d.embedding for d in r.data], llm.embed(TEXTS))
    tokens = sum(len(x) for x in npqwen.embed.embedding_inputs(llm, TEXTS))
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    r = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float", dimensions=16)
    close([r.data[0].embedding], llm.embed([TEXTS[0]], dimensions=16))
    assert abs(np.linalg.norm(r.data[0].embedding) - 1) <= rounding_tolerance(16, 2)   # renormalised after the cut (float32)
    ids = llm.tokenizer.encode("token ids are embedded as they are")
    for given, want in (([ids, ids[:3]], [ids, ids[:3]]), (ids, [ids])):
        r = client.embeddings.create(model="emb", input=given)
        close([d.embedding for d in r.data], llm.embed(want))
    status, body = http_json("POST", server.url + "/v1/embeddings",
                             {"model": "emb", "input": TEXTS[:1], "encoding_format": "float"})
    assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding"
    server.wait_idle()


def test_rerank_by_raw_http_equals_llm_rerank(reranker):
    server, llm = reranker
    query, documents = "What is the capital of China?", ["Beijing is the capital.", "Gravity.", "Paris is in France."]
    want = llm.rerank(query, documents)
    status, body = http_json("POST", server.url + "/v1/rerank", {"model": "rr", "query": query, "documents": documents})
    assert status == 200, body
    results = body["results"]
    assert [r["index"] for r in results] == np.argsort(-want, kind="stable").tolist()   # best first
    close([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])], want)
    assert all("document" not in r for r in results)
    prompts = [npqwen.rerank.prompt_ids(llm.tokenizer, npqwen.rerank.DEFAULT_INSTRUCTION, query, d) for d in documents]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, prompts))
    status, body = http_json("POST", server.url + "/rerank",
                             {"query": query, "documents": [{"text": d} for d in documents], "top_n": 2,
                              "return_documents": True})
    assert status == 200 and len(body["results"]) == 2
    assert [r["document"]["text"] for r in body["results"]] == [documents[r["index"]] for r in body["results"]]
    server.wait_idle()


def test_models_says_which_kind_of_checkpoint_it_is(embedding, reranker):
    assert embedding[0].client().models.list().data[0].kind == "embedding"
    assert http_json("GET", reranker[0].url + "/v1/models")[1]["data"][0]["kind"] == "generation"


@pytest.mark.parametrize("body, param, code", [
    ({"input": []}, "input", None),
    ({"input": [[]]}, "input", None),
    ({"input": "word " * 3000}, "input", "context_length_exceeded"),
    ({"input": [[1, 99999999]]}, "input", None),
    ({"input": "a", "dimensions": 0}, "dimensions", None),
    ({"input": "a", "dimensions": 65}, "dimensions", None),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": 3}, "input", None),
    ({"input": "a", "truncate": True}, "truncate", "unsupported"),
    ({"input": ["a"] * 2049}, "input", None),
])
def test_embeddings_refusals_are_400s_naming_the_field(embedding, body, param, code):
    server, _ = embedding
    status, answer = http_json("POST", server.url + "/v1/embeddings", {"model": "emb", **body})
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["code"] == code, answer
    print(answer["error"]["message"])


def test_rerank_refusals_are_400s_naming_the_field(reranker):
    server, _ = reranker
    for body, param, code in [({"query": "q", "documents": []}, "documents", None),
                              ({"query": "q", "documents": ["d"], "top_n": 0}, "top_n", None),
                              ({"documents": ["d"]}, "query", None),
                              ({"query": "q", "documents": ["x " * 3000]}, "documents", "context_length_exceeded"),
                              ({"query": "q", "documents": [3]}, "documents[0]", None)]:
        status, answer = http_json("POST", server.url + "/v1/rerank", body)
        assert status == 400 and answer["error"]["param"] == param and answer["error"]["code"] == code, answer
    with pytest.raises(openai.NotFoundError):
        server.client().embeddings.create(model="other", input="a")


def test_metrics_count_embeddings_and_rerank(embedding, reranker):
    def counter(server, name):
        text = http_json("GET", server.url + "/metrics")[1]
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + "_total ")))

    before = counter(embedding[0], "npqwen:embedding_inputs")
    embedding[0].client().embeddings.create(model="emb", input=["a", "b"])
    assert counter(embedding[0], "npqwen:embedding_inputs") == before + 2
    before = counter(reranker[0], "npqwen:rerank_documents")
    http_json("POST", reranker[0].url + "/v1/rerank", {"query": "q", "documents": ["a", "b", "c"]})
    assert counter(reranker[0], "npqwen:rerank_documents") == before + 3
