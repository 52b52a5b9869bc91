"""npqwen on Ray Serve (npqwen/ray.py) on a Ray cluster of two one-CPU nodes on this machine, a replica on
each: every route answers through Ray's proxy as `npqwen serve` answers without Ray, each answer names its
replica, the turns of a conversation go to one replica, each replica's metrics reach Ray's, and a replica
killed while it streams ends its stream with an error event while the other serves on and Ray starts a new one."""
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the ray extra (pip install 'npqwen[ray]') is not installed")
sys.path.insert(0, str(Path(__file__).parent))

import npqwen  # noqa: E402
from npqwen.errors import NpqwenError  # noqa: E402
from serving import LiveServer, http_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, said", [
    ({"model": "tiny", "num_replica": 2}, "no option 'num_replica'; did you mean 'num_replicas'?"),
    ({"model": "tiny", "kv_cache_token": 4096}, "did you mean 'kv_cache_tokens'?"),
    ({"model": "tiny", "port": 8001}, "port does not apply under Ray Serve"),
    ({"model": "tiny", "router": "fastest"}, "router must be one of prefix, load, round_robin"),
    ({"model": "tiny", "max_queue": 0}, "--max-queue must be >= 1"),
    ({"model": "tiny", "max_batch_size": "many"}, "max_batch_size: invalid int value: 'many'"),
    ({"model": "tiny", "allow_generation": "perhaps"}, "allow_generation is a switch"),
    ({"model": "tiny", "autoscaling_config": "{min_replicas: 1}"}, "autoscaling_config must be a JSON object"),
])
def test_a_wrong_key_or_value_is_said_before_any_replica_starts(args, said):
    from npqwen.ray import build_app

    with pytest.raises(NpqwenError) as e:
        build_app(args)
    assert said in str(e.value), str(e.value)


def test_the_keys_are_npqwen_serves_options_and_serves():
    from npqwen.ray import build_app, serve_argv

    assert serve_argv({"model": "tiny", "served_model_name": "q", "allow_generation": "true", "lora": ["a=/x"],
                       "kv-cache-tokens": 2048}) == ["--model", "tiny", "--served-model-name", "q",
                                                     "--allow-generation", "--lora", "a=/x",
                                                     "--kv-cache-tokens", "2048"]
    app = build_app({"model": "tiny", "num_replicas": "3", "router": "round_robin"})
    replica = app._bound_deployment.init_args[0]._bound_deployment
    assert replica.num_replicas == 3
    assert replica._deployment_config.request_router_config.request_router_class == "npqwen.ray.RoundRobinRouter"


# -- on a cluster --

@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from npqwen.ray import build_app

    metrics_ports = [free_port(), free_port()]
    system = {"metrics_report_interval_ms": 500}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "metrics_export_port": metrics_ports[0],
                                                            "include_dashboard": False, "_system_config": system})
    cluster.add_node(num_cpus=1, metrics_export_port=metrics_ports[1])
    ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "ERROR"})
    serve.run(build_app({"model": "tiny", "served_model_name": "tiny", "num_replicas": 2,
                         "ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 1}),
              name="npqwen", route_prefix="/")
    llm = npqwen.load("tiny")
    alone = LiveServer(llm, model_name="tiny")
    yield f"http://127.0.0.1:{port}", alone, metrics_ports
    alone.close()
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def post(url: str, body: dict, timeout: float = 60):
    """(status, headers, raw body) of one POST."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


# ids and times differ from answer to answer
VARYING = {"id", "created", "created_at", "completed_at", "item_id", "system_fingerprint", "response_id"}


def same_shape(raw: str):
    """A JSON body or an event stream, without the ids and times that differ from one answer to the next."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) if k != "usage" or not v else
                    {u: n for u, n in v.items() if "output" in u or "completion" in u}   # input: per prefix cache
                    for k, v in value.items() if k not in VARYING}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    if raw.startswith(("data:", "event:")):
        return [strip(json.loads(line[6:])) if line.startswith("data: {") else line
                for line in raw.splitlines() if line]
    return strip(json.loads(raw))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
        "temperature": 0}
ROUTES = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": "tiny", "prompt": "The sky is", "max_tokens": 6, "temperature": 0}),
    ("/v1/responses", {"model": "tiny", "input": "Name a color.", "max_output_tokens": 8, "temperature": 0,
                       "stream": True}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "Name a color."}],
                      "max_tokens": 8, "temperature": 0, "stream": True}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "Name a color."}]}),
    ("/v1/embeddings", {"model": "tiny", "input": "a color"}),
    ("/v1/rerank", {"model": "tiny", "query": "a color", "documents": ["red", "a dog"]}),
    ("/tokenize", {"model": "tiny", "prompt": "Name a color."}),
]


def test_every_route_answers_through_ray_as_without_it(cluster):
    url, alone, _ = cluster
    replicas = set()
    for path, body in ROUTES:
        status, headers, raw = post(url + path, body)
        want_status, _, want = post(alone.url + path, body)
        got, expected = same_shape(raw), same_shape(want)
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None) \
            if isinstance(got, list) and isinstance(expected, list) else None
        assert (status, got) == (want_status, expected), \
            f"{path}: first difference at {first}: {got[first] if first is not None else got} != " \
            f"{expected[first] if first is not None else expected}"
        replicas.add(headers["x-npqwen-replica"])
    status, health = http_json("GET", url + "/health")
    assert status == 200, health
    assert len(replicas) == 2, f"the requests went to {replicas}: one replica only"


def test_the_turns_of_a_conversation_go_to_the_replica_that_holds_them(cluster):
    url, _, _ = cluster
    where = {}
    for turn in range(3):
        for talk in range(4):
            messages = [{"role": "user", "content": f"Conversation {talk}: tell me about topic {talk}. " * 4}]
            for t in range(turn):
                messages += [{"role": "assistant", "content": f"Answer {t}."}, {"role": "user", "content": "More."}]
            status, headers, raw = post(url + "/v1/chat/completions", {**CHAT, "messages": messages, "max_tokens": 1})
            assert status == 200, raw
            where.setdefault(talk, []).append(headers["x-npqwen-replica"])
    assert all(len(set(turns)) == 1 for turns in where.values()), f"turns went to: {where}"
    assert len({turns[0] for turns in where.values()}) == 2, f"every conversation on one replica: {where}"


def test_each_replicas_metrics_reach_rays_with_its_replica_tag(cluster):
    url, _, metrics_ports = cluster
    deadline, seen = time.monotonic() + 30, set()
    while time.monotonic() < deadline and len(seen) < 2:
        for port in metrics_ports:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            seen |= {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                     if line.startswith("ray_npqwen_prompt_tokens_total{") and 'replica="' in line}
        time.sleep(0.5)
    assert len(seen) == 2, f"npqwen_prompt_tokens_total seen for replicas {seen} in Ray's metrics"


def test_a_killed_replica_ends_its_stream_and_the_other_serves_on(cluster):
    import ray
    from ray import serve

    url, _, _ = cluster
    body = {**CHAT, "stream": True, "max_tokens": 3000, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as stream:
        victim = stream.headers["x-npqwen-replica"]
        lines = [stream.readline() for _ in range(6)]   # it is streaming
        actor = ray.get_actor(f"SERVE_REPLICA::npqwen#Replica#{victim}", namespace="serve")
        os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
        killed = time.monotonic()
        rest = stream.read().decode()   # ends: no hang
    ended = time.monotonic() - killed
    assert lines[0].startswith(b"data: {"), lines
    assert rest.endswith("data: [DONE]\n\n") and "replica serving this request was lost" in rest, rest[-400:]
    assert ended < 15, f"the stream ended {ended:.1f} s after the kill"
    status, headers, raw = post(url + "/v1/chat/completions", CHAT)   # at once, on the live one
    assert status == 200, raw
    live, served, deadline, i = headers["x-npqwen-replica"], set(), time.monotonic() + 60, 0
    while time.monotonic() < deadline and not served - {live}:   # Ray starts a new replica, and it serves
        time.sleep(0.5)
        i += 1   # a new prompt each time: one seen before goes where its prefix is
        served.add(post(url + "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"{i} new"}]})
                   [1]["x-npqwen-replica"])
    assert victim not in served and served - {live}, f"served by {served}; killed {victim}"
    app = serve.status().applications["npqwen"].deployments["Replica"]
    assert app.replica_states.get("RUNNING") == 2, app
