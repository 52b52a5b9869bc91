"""docs/scale-out.md: each `serve run` line, the Serve config file, KubeRay's RayService and the Python sample
build the application they say (npqwen.ray:build_app with their keys, checked before any replica starts),
with the built-in tiny model in place of the hub's; the keys table names every Serve key build_app takes.
(Serving through Ray itself runs in tests/test_ray.py, on a cluster.)"""
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the ray extra (pip install 'npqwen[ray]') is not installed")
sys.path.insert(0, str(Path(__file__).parent))

from conftest import ROOT, doc_blocks, doc_samples  # noqa: E402

PAGE = "scale-out.md"
MODELS = {"Qwen/Qwen3-0.6B": "tiny", "Qwen/Qwen3-8B": "tiny"}


def built(args: dict):
    """The Serve application build_app makes of `args` (the model swapped for tiny): its replica deployment."""
    from npqwen.ray import build_app

    args = {k: MODELS.get(v, v) if k == "model" else v for k, v in args.items()}
    app = build_app(args)
    return app._bound_deployment.init_args[0]._bound_deployment


def test_each_serve_run_line_builds_its_app():
    _, shell = doc_samples(PAGE, shown=("console", "yaml", "text"))
    assert len(shell) == 2
    for line in shell:
        words = shlex.split(line)
        assert words[:3] == ["serve", "run", "npqwen.ray:build_app"], line
        args = dict(word.split("=", 1) for word in words[3:])
        assert built(args).num_replicas == int(args["num_replicas"]), line


def test_the_config_file_and_kuberays_rayservice_build_the_app():
    import yaml

    blocks = [yaml.safe_load(code) for kind, code in doc_blocks(ROOT / "docs" / PAGE) if kind == "yaml"]
    config, service = blocks
    assert service["kind"] == "RayService"
    for serve_config in (config, yaml.safe_load(service["spec"]["serveConfigV2"])):
        (app,) = serve_config["applications"]
        assert app["import_path"] == "npqwen.ray:build_app"
        assert built(app["args"]).num_replicas == app["args"]["num_replicas"]


def test_the_python_sample_runs_its_app(monkeypatch):
    from ray import serve

    python, _ = doc_samples(PAGE, shown=("console", "yaml", "text"), swap=MODELS)
    ran = []
    monkeypatch.setattr(serve, "run", lambda app, **kwargs: ran.append((app, kwargs)))
    exec(python[0], {})
    (app, kwargs), = ran
    assert app._bound_deployment.init_args[0]._bound_deployment.num_replicas == 2
    assert kwargs == {"name": "npqwen", "route_prefix": "/"}


def test_the_keys_table_names_every_serve_key():
    from npqwen.ray import SERVE_KEYS

    text = (ROOT / "docs" / PAGE).read_text(encoding="utf-8")
    assert all(f"`{key}`" in text for key in SERVE_KEYS), [k for k in SERVE_KEYS if f"`{k}`" not in text]
