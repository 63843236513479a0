"""methods/ssr.py, synthesize.py and ssr_buffer.py: the completion parse, K-means and the cluster selection on
hand-checked cases; synthesize.py keeps only new, parsed, non-demonstration inputs, stores its demonstrations' record
numbers and embeds with the base model; ssr_buffer.py builds its buffer from synthetic inputs alone (it takes no
training data at all) and the budget exactly; run.py plans SSR's steps (one synthesis per task, shared by stages)."""
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

import synthesize
import ssr_buffer
from methods.ssr import cluster_select, kmeans
import forkserver
from tiny import REPO, TASKS

from engine import sampling


def test_parse_pairs_keeps_complete_input_output_pairs():
    text = " the dog ran\nOutput: A\n\nInput: a red ball\nOutput: B\n\nInput: cut off here\nOut"
    assert synthesize.parse_pairs(text, truncated=True) == [("the dog ran", "A"), ("a red ball", "B")]
    assert synthesize.parse_pairs(text, truncated=False) == [("the dog ran", "A"), ("a red ball", "B")]
    # a chat answer starts with its own "Input:"; pieces without an output or an input are no pair
    assert synthesize.parse_pairs("Input: x y\nOutput: z", truncated=False) == [("x y", "z")]
    assert synthesize.parse_pairs("Input: only an input", truncated=False) == []
    assert synthesize.parse_pairs("Input: \nOutput: B", truncated=False) == []
    # the cap cut the only pair: nothing
    assert synthesize.parse_pairs(" x\nOutput: partial ans", truncated=True) == []


def test_kmeans_finds_separated_blobs_and_is_a_fixed_point():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.3 * torch.randn(20, 2, generator=g) for c in centers])
    labels, c = kmeans(x, 3, seed=1)
    assert sorted(len(set(labels[i * 20:(i + 1) * 20].tolist())) for i in range(3)) == [1, 1, 1]
    assert len(set(labels.tolist())) == 3
    # Lloyd's fixed point: each point at its nearest centroid, each centroid its members' mean (naive loops)
    for i in range(len(x)):
        d = [float(((x[i].double() - c[j]) ** 2).sum()) for j in range(3)]
        assert d[int(labels[i])] == min(d)
    for j in range(3):
        members = [x[i].double() for i in range(len(x)) if labels[i] == j]
        assert torch.allclose(c[j], sum(members) / len(members))
    assert torch.equal(kmeans(x, 3, seed=1)[0], labels)  # deterministic in the seed


def test_cluster_select_takes_each_clusters_share_closest_to_its_centroid():
    # two directions (the embeddings are L2-normalised): 6 points near (1, 0), 2 near (0, 1)
    a = [[1.0, 0.01 * i] for i in range(6)]
    b = [[0.02 * i, 1.0] for i in range(2)]
    emb = torch.tensor(a + b)
    picked = cluster_select(emb, 4, k=2, seed=0)
    assert len(picked) == 4
    assert sum(i < 6 for i in picked) == 3 and sum(i >= 6 for i in picked) == 1  # round(4 * 6/8), round(4 * 2/8)
    # within the big cluster, the members closest to its centroid (the middle of 0..5 in angle)
    assert sorted(i for i in picked if i < 6) == [1, 2, 3]
    assert cluster_select(emb, 8, k=2, seed=0) == list(range(8))
    assert cluster_select(emb, 0, k=2, seed=0) == []
    assert cluster_select(torch.zeros(0, 2), 5, k=2, seed=0) == []


def canned(tok, texts):
    """A stand-in for engine.sampling.generate that answers the prompts with `texts` in turn (the tiny random model
    writes no Input/Output pairs)."""
    def generate(ckpt, prompts, **kw):
        return [{"token_ids": tok.encode(texts[i % len(texts)]), "finish_reason": "stop"} for i in range(len(prompts))]
    return generate


def test_synthesize_keeps_new_parsed_inputs_and_records_its_demonstrations(tiny_env, tmp_path, monkeypatch):
    from model.tokenizer import ChatTokenizer
    tok = ChatTokenizer.from_dir(tiny_env["base"])
    demo_prompt = f"{TASKS[0]} statement 1: the cat sat. Answer A or B."
    texts = [" a brand new input\nOutput: B\n\nInput: another one\nOutput: A",
             f" {demo_prompt}\nOutput: B",        # a demonstration's own input: not new
             " a brand new input\nOutput: A",    # a duplicate input
             " no output here"]
    monkeypatch.setattr(sampling, "generate", canned(tok, texts))
    out = tmp_path / "synth"
    synthesize.main(["--ckpt", str(tiny_env["base"]), "--data", str(tiny_env["data"]), "--tasks", TASKS[0],
                     "--out", str(out), "--demos", "4", "--prompts", "3", "--samples", "2", "--quiet"])
    records = [json.loads(x) for x in (out / "synth.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["a brand new input", "another one"]
    assert all(r["task"] == TASKS[0] for r in records) and [r["idx"] for r in records] == [0, 1]
    info = json.loads((out / "info.json").read_text())
    assert info["task"] == TASKS[0] and sorted(info["demos"]) == [0, 1, 2, 3] and info["prompts"] == 3
    assert info["completions"] == 6 and info["kept"] == 2
    emb = load_file(out / "embeddings.safetensors")["embeddings"]
    assert emb.shape[0] == 2
    # the base model's mean final hidden state over the chat-templated input
    from model.checkpoint import load_model
    model = load_model(tiny_env["base"])
    ref = synthesize.embed(model, [tok.prompt_ids("another one")])[0]
    assert torch.allclose(emb[1], ref, rtol=1e-5, atol=1e-6)


def test_ssr_buffer_is_built_from_synthetic_inputs_alone(tiny_env, tmp_path):
    """ssr_buffer.py has no --data: it cannot read a training prompt. Its buffer holds exactly the budget, from the
    synthetic inputs, answered by the checkpoint."""
    dirs = []
    for t, n in zip(TASKS, (7, 3)):
        d = tmp_path / t
        d.mkdir()
        recs = [{"task": t, "idx": i, "prompt": f"synthetic {t} input {i} the cat", "icl_output": "A"}
                for i in range(n)]
        (d / "synth.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        torch.manual_seed(n)
        from safetensors.torch import save_file
        save_file({"embeddings": torch.randn(n, 8)}, d / "embeddings.safetensors")
        (d / "info.json").write_text(json.dumps({"task": t, "demos": [0, 1], "prompts": 1, "completions": 1,
                                                 "kept": n}))
        dirs.append(d)
    out = tmp_path / "buffer.jsonl"
    ssr_buffer.main(["--ckpt", str(tiny_env["base"]), "--synth", ",".join(map(str, dirs)), "--budget", "6",
                     "--clusters", "2", "--max-new-tokens", "4", "--out", str(out), "--quiet"])
    buf = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(buf) == 6 and [r["task"] for r in buf].count(TASKS[0]) == 3  # 6 split evenly over 2 tasks
    synthetic = {f"synthetic {t} input {i} the cat" for t in TASKS for i in range(7)}
    assert all(r["prompt"] in synthetic and r["source"] == "ssr" for r in buf)
    with pytest.raises(SystemExit):
        ssr_buffer.parse_args(["--ckpt", "x", "--synth", "y", "--out", "z", "--data", "root"])


def test_run_plans_one_synthesis_per_task_shared_by_every_stage(tiny_env, tmp_path):
    cmd = [sys.executable, str(REPO / "run.py"), "--model", str(tiny_env["base"]), "--data", str(tiny_env["data"]),
           "--tasks", ",".join(TASKS), "--methods", "ssr", "--epochs", "1", "--global-batch", "4", "--rho", "0.5",
           "--eval-limit", "2", "--max-new-tokens", "4", "--dry-run", "--out", str(tmp_path / "dry")]
    p = forkserver.run(cmd, cwd=REPO, env=tiny_env["env"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    import plan
    steps = plan.parse_plan(p.stdout)
    synth = {k: s for k, s in steps.items() if s["kind"] == "synth"}
    ssr = [s for s in steps.values() if s["kind"] == "ssr"]
    assert len(synth) == 1 and all(not s["deps"] for s in synth.values())  # task 1's, read after stage 1
    assert len(ssr) == 1 and set(ssr[0]["deps"]) - set(synth) == {next(k for k, s in steps.items()
                                                                     if s["kind"] == "train" and not s["deps"])}


def test_run_py_runs_ssr_end_to_end(tiny_env, tmp_path):
    """The steps run through run.py (the random tiny base writes no parseable pair: an empty buffer, trained as sft
    is, which the pipeline must carry as any buffer)."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "run.py"), "--model", str(tiny_env["base"]), "--data", str(tiny_env["data"]),
           "--tasks", ",".join(TASKS), "--methods", "ssr", "--epochs", "1", "--global-batch", "4", "--rho", "0.5",
           "--eval-limit", "2", "--max-new-tokens", "4", "--ssr-demos", "3", "--ssr-prompts", "4", "--quiet",
           "--out", str(out)]
    p = forkserver.run(cmd, cwd=REPO, env=tiny_env["env"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ssr"]
    manifest = json.loads((out / "manifest.json").read_text())
    kinds = [s["kind"] for s in manifest.values()]
    assert kinds.count("synth") == 1 and kinds.count("ssr") == 1
    buffers = list((out / "steps").glob("s1-ssr-*/buffer.jsonl"))
    info = json.loads(next((out / "steps").glob("synth-*/synth/info.json")).read_text())
    assert len(buffers) == 1 and info["task"] == TASKS[0] and len(info["demos"]) == 3
