"""LoRA adapters on the server, through the openai client: `model` names an adapter, /v1/models lists them
with their parent, vLLM's load and unload routes only with --allow-runtime-lora."""
import json

import numpy as np
import pytest

import npqwen
from npqwen.checkpoint import save_safetensors
from npqwen.lora import ATTENTION, TARGETS

from serving import LiveServer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


def random_adapter(path, llm, r: int = 4, alpha: float = 16, targets=TARGETS, seed: int = 0):
    """A PEFT-shaped adapter for `llm` written without torch: random A and B on every layer's `targets`."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(llm.config.num_hidden_layers):
        for t in targets:
            module = f"model.layers.{i}.{'self_attn' if t in ATTENTION else 'mlp'}.{t}"
            out, in_ = llm.weights[f"{module}.weight"].shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((r, in_)).astype(np.float32) * 0.3
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((out, r)).astype(np.float32) * 0.3
    save_safetensors(path / "adapter_model.safetensors", tensors)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                          "target_modules": list(targets)}))
    return path


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    llm = npqwen.load("tiny", lora={"poet": random_adapter(root / "poet", npqwen.load("tiny"))})
    server = LiveServer(llm, allow_runtime_lora=True)
    server.root = root
    yield server
    server.close()


def greedy(client, model: str, prompt: str = "Once upon a time") -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text


def test_model_names_the_adapter(lora_server):
    client, llm = lora_server.client(), lora_server.llm
    cards = {m.id: m for m in client.models.list().data}
    print({name: getattr(card, "parent", None) for name, card in cards.items()})
    assert set(cards) == {"test-model", "poet"} and cards["poet"].parent == "test-model"
    assert client.models.retrieve("poet").parent == "test-model"
    ours, base = greedy(client, "poet"), greedy(client, "test-model")
    assert ours == llm.generate("Once upon a time", max_new_tokens=8, temperature=0, lora="poet").text
    assert base == llm.generate("Once upon a time", max_new_tokens=8, temperature=0).text and ours != base
    chat = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    want = llm.chat("hi", max_new_tokens=6, temperature=0, lora="poet")
    assert chat.choices[0].message.content == want.content
    with pytest.raises(openai.NotFoundError, match="this server serves 'test-model', 'poet'"):
        greedy(client, "prose")
    with pytest.raises(openai.NotFoundError, match="LoRA adapters apply to generation only"):
        client.embeddings.create(model="poet", input="hi")
    lora_server.wait_idle()


def test_load_and_unload_at_run_time(lora_server):
    client = lora_server.client()
    path = random_adapter(lora_server.root / "bard", lora_server.llm, r=2, targets=("q_proj", "down_proj"), seed=5)
    said = client.post("/load_lora_adapter", body={"lora_name": "bard", "lora_path": str(path)}, cast_to=str)
    assert said == "Success: LoRA adapter 'bard' added successfully."
    assert [m.id for m in client.models.list().data] == ["test-model", "poet", "bard"]
    assert greedy(client, "bard") == lora_server.llm.generate("Once upon a time", max_new_tokens=8, temperature=0,
                                                              lora="bard").text
    with pytest.raises(openai.BadRequestError, match="loaded already"):
        client.post("/load_lora_adapter", body={"lora_name": "bard", "lora_path": str(path)}, cast_to=str)
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json"):
        client.post("/load_lora_adapter", body={"lora_name": "x", "lora_path": str(lora_server.root)}, cast_to=str)
    client.post("/unload_lora_adapter", body={"lora_name": "bard"}, cast_to=str)
    assert [m.id for m in client.models.list().data] == ["test-model", "poet"]
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'bard' is loaded"):
        client.post("/unload_lora_adapter", body={"lora_name": "bard"}, cast_to=str)
    with pytest.raises(openai.NotFoundError):
        greedy(client, "bard")
    lora_server.wait_idle()


def test_runtime_loading_is_off_by_default(lora_server):
    server = LiveServer(lora_server.llm)
    try:
        with pytest.raises(openai.NotFoundError, match="--allow-runtime-lora"):
            server.client().post("/load_lora_adapter", body={"lora_name": "b", "lora_path": "/etc"}, cast_to=str)
        assert greedy(server.client(), "poet") == greedy(lora_server.client(), "poet")
    finally:
        server.close()


def test_cli_generate_lora_name(lora_server, capsys):
    from npqwen.cli import main

    llm, path = lora_server.llm, lora_server.root / "poet"
    bard = random_adapter(lora_server.root / "bard2", llm, seed=9)
    common = ["generate", "--model", "tiny", "--raw", "-p", "Once upon a time", "--max-new-tokens", "8",
              "--temperature", "0", "--lora", f"poet={path}"]
    assert main(common) == 0   # the only --lora is used
    assert capsys.readouterr().out == llm.generate("Once upon a time", max_new_tokens=8, temperature=0,
                                                   lora="poet").text + "\n"
    assert main(common + ["--lora", f"bard={bard}"]) == 0   # two, none picked: the base model
    assert capsys.readouterr().out == llm.generate("Once upon a time", max_new_tokens=8, temperature=0).text + "\n"
    assert main(common + ["--lora", f"bard={bard}", "--lora-name", "poet"]) == 0
    assert capsys.readouterr().out == llm.generate("Once upon a time", max_new_tokens=8, temperature=0,
                                                   lora="poet").text + "\n"
