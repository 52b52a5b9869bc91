"""Tensor parallelism: the split itself, and the model over 2 (or 4) MPI ranks in subprocesses
(mpiexec) against one process: logits, greedy and seeded tokens, the batched engine, the commands,
the server, and what happens when a rank dies, hangs or cannot load its part; and Qwen3.5 (hybrid) models,
whose linear-attention heads and state slots are split too."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import npqwen
from npqwen.checkpoint import expected_shapes
from npqwen.config import Qwen3Config
from npqwen.parallel import check_split, heads_of, shard_shape, shards, split_range

from conftest import QWEN3_0_6B, ROOT, tiny_config, write_npqwen_checkpoint
from tolerance import model_tolerance, relative_diff

pytest.importorskip("mpi4py")
PROBE = ROOT / "tests" / "parallel_probe.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
       "OPENBLAS_NUM_THREADS": "1"}


def mpiexec() -> str:
    from npqwen.cli.parallel import find_mpiexec
    return find_mpiexec()


def mpirun(n: int, *command, timeout: float = 180, env=None) -> subprocess.CompletedProcess:
    """`mpiexec -n N COMMAND` from the repository root; its stdout/stderr printed if it fails."""
    result = subprocess.run([mpiexec(), "-n", str(n), *map(str, command)], capture_output=True, text=True,
                            cwd=ROOT, env=env or ENV, timeout=timeout)
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:])
    return result


def probe(model, out: Path, tp: int = 0, *flags) -> list[dict]:
    """tests/parallel_probe.py in one process (tp=0) or on tp ranks; what each rank got."""
    command = [sys.executable, PROBE, model, out, *flags]
    if tp:
        assert mpirun(tp, *command, "--tp").returncode == 0
    else:
        result = subprocess.run(list(map(str, command)), capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    return [dict(np.load(f"{out}.rank{r}.npz")) for r in range(max(tp, 1))]


def npqwen_cli(*args, tp=None, stdin=None, env=None, timeout=120) -> subprocess.CompletedProcess:
    extra = ["--tensor-parallel-size", str(tp)] if tp is not None else []
    return subprocess.run([sys.executable, "-m", "npqwen", *map(str, args), *extra], capture_output=True, text=True,
                          input=stdin, cwd=ROOT, env=env or ENV, timeout=timeout)


def assert_same(one: dict, ranks: list[dict], cfg):
    """Every rank got exactly rank 0's answer, and rank 0 one process's: tokens and texts equal, arrays within
    model_tolerance of the model `cfg` at the tokens each array's call read. Not exactly: the ranks split the
    sums of o_proj, down_proj and out_proj (each adds its half, then the all-reduce adds the halves), which
    rounds unlike one process's whole sums."""
    for key, want in one.items():
        if key in ("peak_rss", "shapes"):
            continue
        for r, got in enumerate(ranks):
            assert got[key].shape == want.shape, (key, r, got[key].shape, want.shape)
            if want.dtype.kind in "iuU":
                mismatch = np.flatnonzero(np.asarray(got[key] != want).reshape(-1))
                assert not mismatch.size, f"{key}, rank {r}: first mismatch at {mismatch[0]}: {got[key]} vs {want}"
            else:   # logits_N read N tokens; every other call of the probe at most 40
                tolerance = model_tolerance(cfg, int(key.split("_")[1]) if key.startswith("logits_") else 40)
                diff = relative_diff(got[key], want)
                print(f"{key}: rank {r} relative max |diff| from one process {diff:.2e} (tolerance {tolerance:.1e})")
                assert diff <= tolerance, (key, r, diff, tolerance)
                assert np.array_equal(got[key], ranks[0][key]), f"{key}: rank {r} differs from rank 0"


# ---------------------------------------------------------------------------- the split, no MPI

def test_split_takes_whole_heads_and_slices_of_width_and_vocabulary():
    cfg = Qwen3Config.from_dict({**QWEN3_0_6B, "num_hidden_layers": 1, "vocab_size": 1001})   # small to count
    shapes = expected_shapes(cfg)
    assert [list(split_range(10, 3, i)) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert heads_of(cfg, 2, 1) == (range(8, 16), range(4, 8))              # 16 query heads, 8 kv heads
    assert heads_of(cfg, 16, 5) == (range(5, 6), range(2, 3))              # 16 ranks: kv head 2 on ranks 4, 5
    for n in (2, 4, 16):
        parts = [shards(cfg, shapes, n, r) for r in range(n)]
        for name, shape in shapes.items():   # how many ranks hold each element: the parts tile each tensor
            held = np.zeros(shape, dtype=np.int32)
            for part in parts:
                held[part[name]] += 1
            if name.endswith("norm.weight"):
                want = n                                         # whole on every rank
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                want = max(1, n // cfg.num_key_value_heads)      # 16 ranks: each kv head on 2 of them
            else:
                want = 1
            assert (held == want).all(), (n, name)
        q = shard_shape(shapes["model.layers.0.self_attn.q_proj.weight"], parts[0]["model.layers.0.self_attn.q_proj.weight"])
        assert q == (2048 // n, 1024)
        assert shard_shape(shapes["model.layers.0.mlp.down_proj.weight"],
                           parts[0]["model.layers.0.mlp.down_proj.weight"]) == (1024, 3072 // n)


def test_sizes_that_do_not_split_the_heads_are_refused_with_the_sizes():
    cfg = Qwen3Config.from_dict(QWEN3_0_6B)
    for n, words in ((0, ">= 1"), (3, "16 query heads"), (32, "16 query heads")):
        with pytest.raises(npqwen.NpqwenError, match=words):
            check_split(cfg, n)
    odd = Qwen3Config.from_dict({**QWEN3_0_6B, "num_attention_heads": 24, "num_key_value_heads": 8})
    with pytest.raises(npqwen.NpqwenError, match="not the 8 key/value heads"):
        check_split(odd, 12)   # 12 divides 24 query heads; neither 8 | 12 nor 12 | 8
    check_split(cfg, 16)       # 16 > 8 kv heads, a multiple: each kv head kept by 2 ranks


def test_bad_sizes_and_missing_pieces_are_one_error_before_loading(tmp_path):
    started = time.monotonic()
    for n, words in ((0, "must be >= 1"), (3, "does not split the model's 4 query heads")):
        result = npqwen_cli("generate", "--model", "tiny", "-p", "hi", tp=n)
        assert result.returncode == 1 and result.stderr.count("npqwen: error:") == 1, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr
    result = npqwen_cli("generate", "--model", "tiny", "-p", "hi", tp=2,
                        env={**ENV, "NPQWEN_MPIEXEC": str(tmp_path / "nowhere" / "mpiexec")})
    assert result.returncode == 1 and "NPQWEN_MPIEXEC" in result.stderr, result.stderr
    no_mpi4py = subprocess.run([sys.executable, "-c", "import sys; sys.modules['mpi4py'] = None\n"
                                "from npqwen.cli import main; sys.exit(main(['serve', '--model', 'tiny', "
                                "'--tensor-parallel-size', '2']))"], capture_output=True, text=True, env=ENV, cwd=ROOT)
    assert no_mpi4py.returncode == 1 and "pip install 'npqwen[distributed]'" in no_mpi4py.stderr, no_mpi4py.stderr
    assert time.monotonic() - started < 30


# ---------------------------------------------------------------------------- over MPI ranks

@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    """A tiny float32 checkpoint with an untied lm_head and a vocabulary and MLP width that 2 does not divide."""
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("tp_uneven"),
                                   tiny_config(tie_word_embeddings=False, vocab_size=509, intermediate_size=95))


@pytest.mark.parametrize("which", ["tied-bf16", "untied-uneven"])
def test_two_ranks_compute_what_one_process_does(which, npqwen_tiny_dir, uneven_dir, tmp_path):
    model = npqwen_tiny_dir if which == "tied-bf16" else uneven_dir
    one = probe(model, tmp_path / "one")[0]
    ranks = probe(model, tmp_path / "tp", 2)
    assert_same(one, ranks, npqwen.load(model).config)
    shapes = [json.loads(str(r["shapes"])) for r in ranks]
    assert sum(s["lm_head.weight"][0] for s in shapes) == npqwen.load(model).config.vocab_size
    assert shapes[0]["model.layers.0.self_attn.q_proj.weight"] == [2 * 32, 64]    # 2 of the 4 heads, Dh 32
    assert shapes[1]["model.layers.0.self_attn.o_proj.weight"] == [64, 2 * 32]    # the columns of those heads
    stats = json.loads(str(ranks[0]["engine_stats"]))
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0   # the engine run covered both
    assert "max_new_tokens" in str(ranks[1]["error"])                          # rank 0's error, on rank 1


def test_four_ranks_replicate_the_key_value_heads(npqwen_tiny_dir, tmp_path):
    """4 ranks, 4 query heads, 2 kv heads: each kv head is kept by 2 ranks, each with one of its query heads."""
    one = probe(npqwen_tiny_dir, tmp_path / "one", 0, "--heavy", "--lengths", "1,37")[0]
    ranks = probe(npqwen_tiny_dir, tmp_path / "tp", 4, "--heavy", "--lengths", "1,37")
    assert_same(one, ranks, npqwen.load(npqwen_tiny_dir).config)
    assert json.loads(str(ranks[3]["shapes"]))["model.layers.0.self_attn.k_proj.weight"] == [32, 64]


def test_qwen3_0_6b_shape_over_two_ranks(qwen3_0_6b_shape, tmp_path):
    """The exact Qwen3-0.6B shape: logits within model_tolerance of one process at 1 to 300 tokens, greedy tokens
    equal, and each rank's peak RSS (weights + KV pages, before the long logits) at most 0.6 of one process's."""
    flags = ("--heavy", "--lengths", "1,17,300")
    one = probe(qwen3_0_6b_shape, tmp_path / "one", 0, *flags)[0]
    ranks = probe(qwen3_0_6b_shape, tmp_path / "tp", 2, *flags)
    assert_same(one, ranks, Qwen3Config.from_dict(json.loads((qwen3_0_6b_shape / "config.json").read_text())))
    for r, got in enumerate(ranks):
        ratio = int(got["peak_rss"]) / int(one["peak_rss"])
        print(f"rank {r}: peak RSS {int(got['peak_rss']) / 1e9:.2f} GB, {ratio:.2f} of one process's "
              f"{int(one['peak_rss']) / 1e9:.2f} GB")
        assert ratio <= 0.6


def test_generate_and_chat_print_what_one_process_prints(tmp_path):
    args = ("generate", "--model", "tiny", "--raw", "-t", "0", "-n", "24", "-p", "The cat sat on")
    one, two = npqwen_cli(*args), npqwen_cli(*args, tp=2)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and len(one.stdout) > 10
    assert two.stderr.count("generation: 24 tokens") == 1          # rank 0's statistics only
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in (
        {"prompt": "one", "max_new_tokens": 9}, {"prompt": "two two", "temperature": 0.7, "seed": 3},
        {"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 5})))
    args = ("generate", "--model", "tiny", "-t", "0", "-n", "12", "--prompts-file", prompts)
    one, two = npqwen_cli(*args), npqwen_cli(*args, tp=2)
    assert two.returncode == 0 and two.stdout == one.stdout and two.stdout.count("\n") == 3, two.stderr
    args = ("chat", "--model", "tiny", "-t", "0", "-n", "10")
    one, two = npqwen_cli(*args, stdin="hello\nagain\n"), npqwen_cli(*args, tp=2, stdin="hello\nagain\n")
    assert two.returncode == 0 and two.stdout == one.stdout and ">>> " in one.stdout, two.stderr


def test_a_rank_that_cannot_load_its_part_stops_every_rank_with_one_error(tmp_path):
    """NaN in the rows of query head 3 (rank 1's half): rank 0 loads fine, rank 1 cannot; one error, no hang."""
    model = npqwen.load("tiny").save(tmp_path / "model")
    from npqwen.checkpoint import read_safetensors_header
    info = read_safetensors_header(model / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    data = np.memmap(model / "model.safetensors", dtype=np.float32, mode="r+", offset=info.start, shape=info.shape)
    data[3 * 8] = np.nan   # head 3 of Dh 8: rank 1's
    data.flush()
    del data
    started = time.monotonic()
    result = npqwen_cli("generate", "--model", model, "--raw", "-p", "hi", tp=2)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("npqwen: error:")]
    assert len(errors) == 1 and "rank 1 of 2 could not load its part" in errors[0] and "NaN" in errors[0], errors
    assert time.monotonic() - started < 60


def test_a_stuck_rank_makes_the_collective_time_out(tmp_path):
    """Rank 1 stops answering (it sleeps before its first forward pass): rank 0 gives up after
    NPQWEN_TP_TIMEOUT seconds with the reason, and the group ends instead of hanging."""
    script = tmp_path / "stuck.py"
    script.write_text("import time, npqwen\n"
                      "llm = npqwen.load('tiny', tensor_parallel=True)\n"
                      "if llm.comm.rank == 1:\n    time.sleep(60)\n"
                      "try:\n    llm.forward([1, 2, 3])\n"
                      "except npqwen.NpqwenError as e:\n    print('rank 0:', e, flush=True)\n")
    started = time.monotonic()
    result = mpirun(2, sys.executable, script, env={**ENV, "NPQWEN_TP_TIMEOUT": "2"}, timeout=50)
    assert time.monotonic() - started < 30
    assert "rank 0: tensor parallel: rank 0 waited 2 s for an all-reduce" in result.stdout, result.stdout
    assert result.returncode != 0


# ---------------------------------------------------------------------------- hybrid models (Qwen3.5) over 2 ranks

def test_a_hybrid_model_splits_whole_linear_heads_and_its_states():
    """Qwen3.5 at a small size (Hk=2 key heads of 16, Hv=4 value heads of 8; H=4, K=2 of Dh 32) over 2 ranks:
    every element held once (norms by both), each rank's q, k, v rows of in_proj_qkv, and its state slots'
    shapes (its own heads only)."""
    from hybrid_checkpoints import hybrid_config

    from npqwen.tiny import tiny_model

    cfg = Qwen3Config.from_dict({k: v for k, v in hybrid_config().items() if k != "rope_parameters"})
    shapes = expected_shapes(cfg)
    parts = [shards(cfg, shapes, 2, r) for r in range(2)]
    for name, shape in shapes.items():
        held = np.zeros(shape, dtype=np.int32)
        for part in parts:
            held[part[name]] += 1
        assert (held == (2 if name.endswith("norm.weight") else 1)).all(), name
    p = "model.layers.0.linear_attn"
    rows = parts[1][p + ".in_proj_qkv.weight"][0]   # q rows 0..31, k rows 32..63, v rows 64..95
    assert rows.tolist() == [*range(16, 32), *range(48, 64), *range(80, 96)]
    assert [shard_shape(shapes[p + n], parts[1][p + n]) for n in (".conv1d.weight", ".in_proj_z.weight", ".A_log",
                                                                   ".in_proj_b.weight", ".out_proj.weight")] \
        == [(48, 1, 4), (16, 64), (2,), (2, 64), (64, 16)]
    q = "model.layers.3.self_attn.q_proj.weight"   # each head's 32 query rows and 32 gate rows, together
    assert parts[1][q][0] == slice(128, 256)
    rank_1 = tiny_model(name="tiny-qwen3.5", comm=type("Rank1", (), {"size": 2, "rank": 1})())
    states = rank_1.new_kv_cache(2, 8, num_slots=3).states   # tiny-qwen3.5: Hk=2, Hv=4 of dk=dv=8, 3 linear layers
    assert rank_1.linear_heads == (1, 2)
    assert states.conv.shape == (3, 3, 3, 2 * 8 + 2 * 8) and states.recurrent.shape == (3, 3, 2, 8, 8)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    """Random Qwen3.5, Qwen3.5-MoE and Qwen3-Next saved by transformers, each made when first asked for:
    Hk=2, Hv=4, an untied lm_head and a vocabulary 2 does not divide (the mixtures: 8 experts of width 16,
    a shared expert of 24)."""
    pytest.importorskip("transformers")
    import hybrid_checkpoints as hc

    made = {}

    def get(which):
        if which not in made:
            config = {"qwen3.5": hc.hybrid_config, "qwen3.5-moe": hc.hybrid_moe_config,
                      "qwen3-next": hc.qwen3_next_config}
            made[which] = hc.build_hybrid_checkpoint(tmp_path_factory.mktemp(which) / "model",
                                                     config[which](tie_word_embeddings=False, vocab_size=509))
        return made[which]
    return get


def two_ranks_as_one(model, tmp_path) -> list[dict]:
    """The probe in one process and on 2 ranks, compared by assert_same."""
    one = probe(model, tmp_path / "one")[0]
    ranks = probe(model, tmp_path / "tp", 2)
    assert_same(one, ranks, npqwen.load(model).config)
    spec = json.loads(str(ranks[0]["speculative_stats"]))   # the same on each rank and in one process (assert_same)
    print("speculative decoding:", spec)
    assert spec["spec_decode_num_draft_tokens"] > spec["spec_decode_num_accepted_tokens"]   # refused: rolled back
    return ranks


@pytest.mark.parametrize("which", ["tiny-qwen3.5", "qwen3.5", "qwen3.5-moe", "qwen3-next"])
def test_hybrid_two_ranks_compute_what_one_process_does(which, hybrid_dirs, tmp_path):
    """Logits, greedy and seeded tokens, the batched engine (state slots, chunked prefill, preemption), prefix
    hits that restore state snapshots, streams, an explicit cache, a recorder: 2 ranks as one process."""
    model = which if which == "tiny-qwen3.5" else hybrid_dirs(which)
    ranks = two_ranks_as_one(model, tmp_path)
    shapes = [json.loads(str(r["shapes"])) for r in ranks]
    cfg = npqwen.load(model).config
    p = "model.layers.0.linear_attn"
    Hk, dk, Hv, dv = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                      cfg.linear_value_head_dim)
    C = 2 * Hk * dk + Hv * dv   # q, k, v rows; Qwen3-Next's one matrix also holds z
    rows = shapes[1][p + ".in_proj_qkvz.weight"][0] if cfg.qwen3_next else shapes[1][p + ".in_proj_qkv.weight"][0]
    assert rows == (C + Hv * dv * cfg.qwen3_next) // 2 and shapes[1][p + ".A_log"] == [Hv // 2]
    assert shapes[0][p + ".out_proj.weight"] == [cfg.hidden_size, Hv * dv // 2]
    if cfg.num_experts:   # every rank a slice of every expert's width
        assert shapes[1]["model.layers.0.mlp.experts.7.down_proj.weight"] == [cfg.hidden_size, 8]
    stats = json.loads(str(ranks[0]["engine_stats"]))
    print("batched engine run:", stats)
    assert stats["preemptions"] > 0                                            # a preempted request restarted
    stats = json.loads(str(ranks[0]["prefix_hit_stats"]))
    print("prefix-hit engine run:", stats)
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["state_snapshots"] > 0   # restored on both ranks


def test_a_qwen3_moe_over_two_ranks_splits_every_expert_by_width(tmp_path):
    """tiny-moe (8 experts of width 24, 2 per token): each rank holds 12 of every expert's width; one
    all-reduce after the sum over the experts."""
    ranks = two_ranks_as_one("tiny-moe", tmp_path)
    shapes = json.loads(str(ranks[1]["shapes"]))
    assert shapes["model.layers.1.mlp.experts.5.gate_proj.weight"] == [12, 16]
    assert shapes["model.layers.1.mlp.experts.5.down_proj.weight"] == [16, 12]
    assert shapes["model.layers.1.mlp.gate.weight"] == [8, 16]                    # the router, whole


def test_qwen4_exp_over_two_ranks(tmp_path):
    """tiny-qwen4-exp, saved as a checkpoint (so each rank reads its part of the file and maps the PLE table): split
    as Qwen3.5-MoE (H=4, K=2 of Dh 16; Hk=2, Hv=4; 4 experts of width 16 and a shared one; a vocabulary of 265), its
    C=4 streams, mixing, PLE and QSA indexer whole on each rank. Logits (300 tokens: QSA keeps 2 blocks of 4 and the
    tail), greedy and seeded tokens, the batched engine (chunked, preempted, prefix hits restoring the linear and PLE
    states), a recorder, embeddings and scores: all as one process."""
    model = npqwen.load("tiny-qwen4-exp").save(tmp_path / "model")
    ranks = two_ranks_as_one(model, tmp_path)
    shapes = [json.loads(str(r["shapes"])) for r in ranks]
    a, h = "model.layers.3.self_attn", "model.layers.3.attn_hyper_connection"
    assert shapes[1][f"{a}.q_proj.weight"] == [2 * 2 * 16, 16] and shapes[1][f"{a}.k_proj.weight"] == [16, 16]
    assert shapes[1]["model.layers.0.linear_attn.out_proj.weight"] == [16, 2 * 8]   # 2 of 4 value heads
    assert shapes[1]["model.layers.0.mlp.experts.3.down_proj.weight"] == [16, 8]    # half of every expert's width
    assert shapes[1][f"{a}.indexer.index_qk_proj.weight"] == [(4 + 1) * 16, 16]     # whole: the indexer,
    assert shapes[1][f"{h}.input_mix_weight_down.weight"] == [8, 4 * 16]            # the mixing
    assert shapes[1]["model.layers.0.ple.key_proj.weight"] == [4 * 16, 16]          # and PLE
    assert sum(s["model.embed_tokens.weight"][0] for s in shapes) == 265
    engine, hits = (json.loads(str(ranks[0][k])) for k in ("engine_stats", "prefix_hit_stats"))
    print("batched engine run:", engine, "\nprefix-hit engine run:", hits)
    assert engine["preemptions"] > 0 and hits["prefix_cache_hit_tokens"] > 0 and hits["state_snapshots"] > 0


def test_hybrid_generate_prints_what_one_process_prints_and_bad_sizes_are_refused():
    args = ("generate", "--model", "tiny-qwen3.5", "--raw", "-t", "0", "-n", "24", "-p", "The cat sat on")
    one, two = npqwen_cli(*args), npqwen_cli(*args, tp=2)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and len(one.stdout) > 10
    four = npqwen_cli(*args, tp=4)   # 4 ranks do not split its 2 linear-attention key heads
    assert four.returncode == 1 and four.stderr.count("npqwen: error:") == 1 and "Traceback" not in four.stderr
    assert "does not split the model's 2 linear-attention key heads (linear_num_key_heads)" in four.stderr, four.stderr


# ---------------------------------------------------------------------------- the server over 2 ranks

def start_server(*args, env=None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "npqwen", "serve", "--model", "tiny", "--port", "0",
                             "--tensor-parallel-size", "2", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env or ENV)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        pytest.fail(f"npqwen serve did not start: {line!r}\n{proc.stderr.read()}")
    return proc, line.split(" at ")[1].split("/v1")[0]


def descendants(launcher: int) -> list[int]:
    """The launcher and every process under it, read from /proc."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(pid))
        except (OSError, IndexError):
            pass
    todo, found = [launcher], []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a parent that may never reap it)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of one rank (a Python process with PMI_RANK=rank) among the launcher's descendants."""
    for pid in descendants(launcher):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env and "python" in exe:
            return pid
    raise AssertionError(f"no rank {rank} under pid {launcher}")


def test_serve_answers_as_one_process_and_stops_on_ctrl_c():
    from serving import http_json

    openai = pytest.importorskip("openai")
    llm = npqwen.load("tiny")
    proc, url = start_server()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt="The cat", max_tokens=16, temperature=0)
        assert r.choices[0].text == llm.generate("The cat", max_new_tokens=16, temperature=0).text
        messages = [{"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        want = llm.chat(messages, max_new_tokens=12, temperature=0)
        assert (chat.choices[0].message.content or "") == want.content
        ids = llm.tokenizer.encode("Where did it look?")
        status, body = http_json("POST", url + "/v1/npqwen/attention", {"tokens": ids, "layer": 1})
        from npqwen.trace import Trace
        trace = Trace(layers=[1])
        llm.forward(ids, recorder=trace)
        want = trace["model.layers.1.self_attn.attn_probs"][:, -1, :]           # every head, all 4 of them
        # 2 ranks against one process: the sums of o_proj and down_proj split (see assert_same)
        assert status == 200 and relative_diff(body["heads"], want) <= model_tolerance(llm.config, len(ids)), body
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 0, proc.stderr.read()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_ends_every_process_of_the_group(signum):
    """What systemd, docker or a supervisor sends (`kill PID`), mid-stream: mpiexec puts each rank in a
    session of its own, yet mpiexec, its proxy and both ranks end within seconds, and the port is free."""
    import socket

    openai = pytest.importorskip("openai")
    proc, url = start_server()
    group = descendants(proc.pid)
    assert len(group) >= 4, group   # the launcher, mpiexec, its proxy, two ranks (under their shells)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="The cat", max_tokens=4000, temperature=0,
                                           stream=True)
        try:
            for n, _ in enumerate(stream):
                if n == 3:
                    proc.send_signal(signum)
                    sent = time.monotonic()
        except openai.APIError:
            pass   # the stream may end with an error or cut short: the server is stopping
        proc.wait(15)
        while any(running(pid) for pid in group) and time.monotonic() < sent + 15:
            time.sleep(0.1)
        print(f"every process ended {time.monotonic() - sent:.1f} s after the signal; status {proc.returncode}")
    finally:
        left = [pid for pid in group if running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, [open(f"/proc/{p}/cmdline").read()[:80] for p in left if os.path.exists(f"/proc/{p}")]
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:
        # free for a new server: SO_REUSEADDR, as uvicorn binds, lets a closed connection's TIME_WAIT pass,
        # while a process still listening on the port makes the bind fail
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_rank_killed_mid_stream_ends_the_server_and_the_client_hears_why():
    openai = pytest.importorskip("openai")
    proc, url = start_server()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="The cat", max_tokens=4000, temperature=0,
                                           stream=True)
        with pytest.raises(openai.APIError, match="a rank of the group stopped"):
            for n, _ in enumerate(stream):
                if n == 3:
                    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
                    killed = time.monotonic()
        code = proc.wait(30)
        print(f"the server exited {time.monotonic() - killed:.1f} s after the kill, status {code}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    errors = [line for line in proc.stderr.read().splitlines() if line.startswith("npqwen: error:")]
    assert len(errors) == 1 and "a rank of the group stopped" in errors[0], errors


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_killed_while_idle_ends_every_process_of_the_group_with_status_1(rank):
    """kill -9 of one rank of an idle server: the other rank, mpiexec, its proxy and the launcher end within
    seconds, the launcher with status 1, and one line says why (rank 0 gone: the survivor says it)."""
    proc, _ = start_server()
    group = descendants(proc.pid)
    try:
        os.kill(rank_pid(proc.pid, rank), signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = proc.wait(15)
        except subprocess.TimeoutExpired:
            code = None
        while any(running(pid) for pid in group) and time.monotonic() < killed + 15:
            time.sleep(0.1)
        print(f"rank {rank} killed: every process ended {time.monotonic() - killed:.1f} s after, launcher status {code}")
    finally:
        left = [pid for pid in group if running(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert not left and code == 1, (left, code, proc.stderr.read())
    errors = [line for line in proc.stderr.read().splitlines() if line.startswith("npqwen: error:")]
    assert len(errors) == 1 and "a rank of the group stopped" in errors[0], errors


def test_bench_tp_suite_reports_every_figure(npqwen_tiny_dir):
    """The tp suite on a tiny checkpoint at small sizes: both sides ran, every figure is there; no time asserted."""
    from tools.bench.report import table

    cmd = [sys.executable, "-m", "tools.bench", "--model", npqwen_tiny_dir, "--engines", "npqwen", "--suites", "tp",
           "--tp-prefill", "40", "--tp-new-tokens", "6", "--repeats", "1", "--json"]
    result = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ours = report["engines"]["npqwen"]
    assert ours["tp_split_ranks"] == 2 and len(ours["tp_split_rank_peak_rss_bytes"]) == 2, ours
    for key in ("tp_one_decode_tps", "tp_split_decode_tps", "tp_one_prefill_tps", "tp_split_prefill_tps"):
        assert ours[key] > 0, key
    assert all(0 < share <= 1 for share in ours["tp_split_rank_decode_comm_share"])
    for key in ("tp_decode_vs_one", "tp_prefill_vs_one", "tp_rank_rss_vs_one"):
        assert report["figures"][key] > 0, key
    assert "time in collectives, decode (per rank)" in table(report)
