"""run.py's step builders: one method per kind of step (train, evaluate, rollout, score, gold
replay, drift, a gold buffer's NLL), each adding a step to the pipeline with its typed spec
(pipeline/specs.py: what its key hashes), the steps it reads, the files it reads and the command
that runs it. run.py's plan_chain and plan_probes call them in the order of the paper's algorithm;
what each kind of step must leave behind is STEP_OUTPUTS.

A command's flags that its key holds are written from its spec (spec.argv: pipeline/specs.py's
FLAGS), never from the settings themselves; any other flag it passes is one its spec declares
NEUTRAL (tests/test_flag_keys.py)."""
import sys
from pathlib import Path

from common.errors import UserError
from common.jsonl import read_records
from data.manifest import scorer_files, step_fields
from data.metrics import RULES
from common.outputs import write_jsonl
from data.replay import gold_draw, replay_budget
from data.tasks import get_task
from data.trace import task_file
from pipeline import specs
from pipeline.inputs import Inputs
from pipeline.steps import Pipeline

SCRIPTS = Path(__file__).resolve().parents[1]  # train.py, evaluate.py, ... the steps' commands run


# what each kind of step must have written when it exits 0; otherwise it failed (and is not
# committed) ("a|b": either; a checkpoint over 5 GiB is shards and their index)
STEP_OUTPUTS = {"train": ["ckpt/model.safetensors|ckpt/model.safetensors.index.json"],
                "eval": ["eval/scores.json", "eval/predictions.jsonl"],
                "rollout": ["rollouts.jsonl"], "score": ["buffer.jsonl"],
                "replay": ["buffer.jsonl"], "drift": ["drift/drift.json"],
                "buffer-nll": ["buffer_stats.json"],
                "synth": ["synth/synth.jsonl", "synth/embeddings.safetensors", "synth/info.json"],
                "ssr": ["buffer.jsonl"]}

# what --keep-checkpoints last|final deletes of a committed step: a stage checkpoint's weights (one
# file, or the shards and their index of one over 5 GiB); its logs and config stay, and results.json
# reads its train_log.jsonl
PRUNABLE = {"train": ["ckpt/model*.safetensors", "ckpt/model.safetensors.index.json"]}


class Steps:
    """The step builders: each adds one step to the pipeline, keyed by what changes its numbers (its
    settings, the keys of the steps it reads, the files it reads), with the command that runs it,
    and returns its key. A step planned twice (e.g. stage 1 of every method) is one step."""

    def __init__(self, pipe: Pipeline, cfg: dict, inputs: Inputs, args, engine_name: str,
                 drift_temperature: float):
        self.pipe, self.cfg, self.inputs = pipe, cfg, inputs
        self.drift_temperature = drift_temperature  # drift.py's, part of its steps' keys
        gpus = args.gpus
        # the base checkpoint: every chain starts from it, and gold replay uses its tokenizer
        self.base_files = [inputs.base]
        self.engine = ["--engine", engine_name,
                       "--tp", str(inputs.layout.tp)]  # (1 on the CPU: keys as before)
        self.py = [sys.executable]
        self.save_every = args.save_every  # train steps: resumable states, kept across a
                                           # stop (Pipeline.run_step)
        self.wandb = args.wandb
        # generating steps: one process, or torchrun's ranks as data-parallel workers
        # (engine/workers.py) on this node. The layout is not in their keys: the workers give the
        # tokens one process gives (tests/test_workers.py)
        dp = inputs.layout.dp
        self.gen_py = self.py if dp == 1 else [sys.executable, "-m", "torch.distributed.run",
                                               "--standalone", f"--nproc_per_node={dp}"]
        self.trainer = args.launcher.split() if args.launcher else self.py if gpus <= 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={gpus}"]
        self.spec_flag = ["--task-spec", str(inputs.task_spec)] if args.task_spec else []
        # what generation depends on (keys eval/rollout steps): not the method list or rho, so
        # adding a method or a rho to a run re-uses the evaluations and rollouts of the
        # checkpoints it shares
        self.gen_spec = dict(engine=self.engine,
                             **{k: cfg[k] for k in ("temperature", "max_new_tokens", "max_len")})
        # on GPUs: recomputing blocks in backward saves memory and leaves the numbers as they are
        # (tests/test_train.py): not part of the key
        self.ac = ["--activation-checkpointing"] if cfg["activation_checkpointing"] and gpus else []

    def files(self, split, task_list):
        return [task_file(self.inputs.data_root, t, split) for t in task_list]

    def data(self, max_len: list) -> list:
        """--data and --task-spec (keyed through the files a step reads and its task_fields)
        around the step's --max-len, where its command has always had them."""
        return ["--data", str(self.inputs.data_root), *max_len, *self.spec_flag]

    @staticmethod
    def scorers(task_list):  # a user's own scorer is read like a data file by the
                             # steps that score with it
        return [f for t in task_list for f in scorer_files(get_task(t))]

    def train(self, prev, stage, task_list, buffer_key, seed, extra=(), n_epochs=None,
              memory_key=None):
        """train.py on the checkpoint of `prev` (None: the base) with the train splits of
        `task_list` and the buffer of `buffer_key` (None: no replay); extra: train.py flags (the
        objective); memory_key: a buffer given to train.py as --memory, held out of the mixture
        (agem's episodic memory)."""
        cfg, train_sets, base = self.cfg, self.inputs.train_sets, self.inputs.base
        lora = "--lora-rank" in extra  # a LoRA method's stage (methods/lora.py)
        name = f"s{stage}-train-{task_list[-1] if len(task_list) == 1 else 'joint'}"
        spec = specs.Train(tasks=task_list, seed=seed, lr=cfg["lr"], gb=cfg["global_batch"],
                           extra=list(extra), ep=n_epochs or self.inputs.epochs[task_list[-1]],
                           max_len=cfg["max_len"], mt=cfg["micro_tokens"],
                           max_train=cfg["max_train"], warmup=cfg["warmup"],
                           lr_schedule=cfg["lr_schedule"],
                           task_fields=step_fields(task_list, "data"))

        def build(tmp, dirs):
            records = [{"prompt": e.prompt, "response": e.answer, "task": e.task, "idx": e.idx}
                       for t in task_list for e in train_sets[t]]
            buffer = dirs[buffer_key] / "buffer.jsonl" if buffer_key else None
            if buffer and buffer.stat().st_size:  # (empty: score.py found no rollout
                                                  # short enough to train on)
                records += read_records(buffer, required=("prompt", "response"),
                                        types={"prompt": (str, list)})
            write_jsonl(tmp / "mixture.jsonl", records)
            memory = ["--memory", str(dirs[memory_key] / "buffer.jsonl")] if memory_key else []
            model = dirs[prev] / "ckpt" if prev and not lora else base
            # adapters on the base throughout: a stage continues the previous stage's adapter
            init = ["--lora-init", str(dirs[prev] / "ckpt" / "adapter")] if prev and lora else []
            return self.trainer + [
                str(SCRIPTS / spec.SCRIPT), "--model", str(model),
                "--data", str(tmp / "mixture.jsonl"), "--out", str(tmp / "ckpt"),
                *spec.argv("ep", "lr", "gb", "max_len", "mt", "seed"),
                "--save-every", str(self.save_every), "--resume",
                *spec.argv("warmup", "lr_schedule"), "--quiet", *spec.argv("extra"),
                *memory, *init, *self.ac,
                "--tensorboard",
                str(self.pipe.run_dir / "tb" / "train" / tmp.name.removesuffix(".tmp")),
                *(["--wandb", str(self.pipe.run_dir / "wandb" / tmp.name.removesuffix(".tmp"))]
                  if self.wandb else [])]
        return self.pipe.add("train", name, spec, [d for d in (prev, buffer_key, memory_key) if d],
                             build, reads=(self.files("train", task_list)
                                           + ([] if prev and not lora else self.base_files)))

    def evaluate(self, train_key, stage, task_list, seed):
        """Row `stage` of the matrix: the checkpoint of `train_key`
        (None: the base model, row 0) on `task_list`."""
        cfg, base = self.cfg, self.inputs.base
        spec = specs.Eval(tasks=task_list, seed=seed, gen=self.gen_spec,
                          repeats=cfg["eval_repeats"], scoring=cfg["scoring"], rules=RULES,
                          limit=cfg["eval_limit"], task_fields=step_fields(task_list, "eval"))

        def build(tmp, dirs):
            ckpt = dirs[train_key] / "ckpt" if train_key else base
            return self.gen_py + [
                str(SCRIPTS / spec.SCRIPT), "--ckpt", str(ckpt),
                *self.data(spec.argv("gen.max_len")), *spec.argv("tasks"),
                "--out", str(tmp / "eval"),
                *spec.argv("seed", "repeats", "scoring", "gen.temperature", "gen.max_new_tokens"),
                "--quiet", *spec.argv("gen.engine", "limit")]
        return self.pipe.add("eval", f"s{stage}-eval", spec,
                             [train_key] if train_key else [], build,
                             reads=self.files("test", task_list) + self.scorers(task_list)
                             + ([] if train_key else self.base_files))

    def budget(self, prior, next_task, rho):
        """The budget of the replay buffer built after the stage that trained prior[-1]."""
        cfg = self.cfg
        budget = replay_budget(cfg["replay_budget"], rho, prior, self.inputs.train_sizes, next_task)
        if (budget["total"] if "total" in budget else sum(budget["per_task"].values())) == 0:
            raise UserError(f"--rho {rho}: the replay buffer after stage {len(prior)} would hold 0 "
                            f"examples ({cfg['replay_budget']} budget, round(rho x training "
                            f"examples)); the replay methods would train as sft does: raise --rho "
                            f"or the training set size")
        return budget

    def rollout(self, train_key, stage, prior, seed):
        """rollout.py: the checkpoint of `train_key` answers the training prompts
        of tasks `prior`."""
        cfg = self.cfg
        spec = specs.Rollout(prior=prior, seed=seed, gen=self.gen_spec, max_train=cfg["max_train"],
                             task_fields=step_fields(prior, "rollout"))

        def build(tmp, dirs):
            return self.gen_py + [
                str(SCRIPTS / spec.SCRIPT), "--ckpt", str(dirs[train_key] / "ckpt"),
                *self.data(spec.argv("gen.max_len")), *spec.argv("prior"),
                "--out", str(tmp / "rollouts.jsonl"),
                *spec.argv("seed", "max_train", "gen.temperature", "gen.max_new_tokens"),
                "--quiet", *spec.argv("gen.engine")]
        return self.pipe.add("rollout", f"s{stage}-rollout", spec, [train_key], build,
                             reads=self.files("train", prior))

    def score(self, rollout_key, stage, prior, scorer, mode, seed, next_task, rho):
        """score.py: the OPR buffer of the rollouts of `rollout_key`, the top (or lowest, or a
        random subset) of the budget by `scorer` (ru: the task metric, sc: mean log-prob)."""
        cfg, data_root, base = self.cfg, self.inputs.data_root, self.inputs.base
        draw = f"{seed}:{stage}"  # ties among equal scores drawn anew at every stage, as gold
                                  # replay draws its examples
        # scoring: ru's metric (sc: only the RU-SC correlation in the stats)
        spec = specs.Score(scorer=scorer, mode=mode, budget=self.budget(prior, next_task, rho),
                           seed=draw, scoring=cfg["scoring"], rules=RULES, max_len=cfg["max_len"],
                           task_fields=step_fields(prior, "score"))

        def build(tmp, dirs):  # --max-len and --tokenizer: only what train.py can train on
            return self.py + [
                str(SCRIPTS / spec.SCRIPT), "--rollouts", str(dirs[rollout_key] / "rollouts.jsonl"),
                "--data", str(data_root),
                *spec.argv("scorer", "mode", "budget", "scoring", "max_len"),
                "--tokenizer", str(base), "--tasks", ",".join(prior), *spec.argv("seed"),
                "--out", str(tmp / "buffer.jsonl"), *self.spec_flag]
        return self.pipe.add("score", f"s{stage}-{scorer}-{mode}", spec,
                             [rollout_key], build,
                             reads=self.files("train", prior) + self.scorers(prior))

    def gold_buffer(self, stage, prior, seed, next_task, rho):
        """replay's buffer: a seeded random draw of the budget from the gold training examples
        of tasks `prior`."""
        cfg, train_sets = self.cfg, self.inputs.train_sets
        budget = self.budget(prior, next_task, rho)

        def build(tmp, dirs):
            picked = gold_draw(train_sets, prior, budget, seed)
            write_jsonl(tmp / "buffer.jsonl",
                        [{"prompt": e.prompt, "response": e.answer, "task": t, "idx": e.idx,
                          "source": "gold"} for t, e in picked])
            return None
        spec = specs.Replay(prior=prior, seed=seed, budget=budget, max_len=cfg["max_len"],
                            max_train=cfg["max_train"], task_fields=step_fields(prior, "data"))
        return self.pipe.add("replay", f"s{stage}-gold", spec, [], build,
                             reads=self.files("train", prior) + self.base_files)

    def synthesize(self, task, seed):
        """synthesize.py: the base model writes synthetic inputs of `task` from its
        stored demonstrations (ssr); one step per task and seed, shared by every stage
        and method that reads it."""
        cfg = self.cfg
        spec = specs.Synth(task=task, seed=seed, demos=cfg["ssr_demos"], prompts=cfg["ssr_prompts"],
                           samples=cfg["ssr_samples"], temperature=cfg["ssr_temperature"],
                           template=cfg["ssr_template"],
                           max_new_tokens=cfg["max_new_tokens"], max_len=cfg["max_len"],
                           max_train=cfg["max_train"], engine=self.engine,
                           task_fields=step_fields([task], "data"))

        def build(tmp, dirs):
            return self.gen_py + [
                str(SCRIPTS / spec.SCRIPT), "--ckpt", str(self.inputs.base),
                *self.data(spec.argv("max_len")), *spec.argv("task"), "--out", str(tmp / "synth"),
                *spec.argv("seed", "demos", "prompts", "samples", "temperature", "template",
                           "max_new_tokens", "max_train"),
                "--quiet", *spec.argv("engine")]
        return self.pipe.add("synth", f"synth-{task}", spec, [], build,
                             reads=self.files("train", [task]) + self.base_files)

    def ssr_buffer(self, train_key, synth_keys, stage, prior, seed, next_task, rho):
        """ssr_buffer.py: SSR's buffer after stage `stage`: each prior task's synthetic inputs
        (synth_keys, in task order) chosen by K-means and answered by the checkpoint of `train_key`.
        It reads no training file."""
        cfg = self.cfg
        draw = f"{seed}{stage:03d}"  # the K-means start drawn anew at every stage, as gold
                                     # replay draws its examples
        spec = specs.Ssr(prior=prior, seed=int(draw), budget=self.budget(prior, next_task, rho),
                         clusters=cfg["ssr_clusters"], gen=self.gen_spec,
                         task_fields=step_fields(prior, "data"))

        def build(tmp, dirs):
            return self.gen_py + [
                str(SCRIPTS / spec.SCRIPT), "--ckpt", str(dirs[train_key] / "ckpt"),
                "--synth", ",".join(str(dirs[k] / "synth") for k in synth_keys),
                *spec.argv("budget", "clusters", "gen.max_new_tokens", "gen.max_len", "seed"),
                "--out", str(tmp / "buffer.jsonl"), "--quiet", *spec.argv("gen.engine")]
        return self.pipe.add("ssr", f"s{stage}-ssr", spec, [train_key, *synth_keys], build)

    def drift(self, cur_key, prev_key, stage, prior, seed):
        """drift.py: KL(pi_cur || pi_prev) per update on the test prompts of tasks `prior`."""
        cfg = self.cfg
        spec = specs.Drift(prior=prior, seed=seed, limit=cfg["drift_limit"],
                           temperature=self.drift_temperature, max_new_tokens=cfg["max_new_tokens"],
                           max_len=cfg["max_len"], engine=self.engine,
                           task_fields=step_fields(prior, "data"))

        def build(tmp, dirs):
            return self.gen_py + [
                str(SCRIPTS / spec.SCRIPT), "--ckpt", str(dirs[cur_key] / "ckpt"),
                "--ref", str(dirs[prev_key] / "ckpt"), *self.data(spec.argv("max_len")),
                *spec.argv("prior"), "--out", str(tmp / "drift"),
                *spec.argv("seed", "limit", "max_new_tokens"), "--quiet", *spec.argv("engine")]
        return self.pipe.add("drift", f"s{stage}-drift", spec, [cur_key, prev_key],
                             build, reads=self.files("test", prior))

    def gold_nll(self, train_key, buffer_key, stage):
        """buffer_nll.py: a gold buffer's per-token NLL under the checkpoint of `train_key`,
        which it followed."""
        spec = specs.BufferNll(self.cfg["max_len"])

        def build(tmp, dirs):
            return self.py + [str(SCRIPTS / spec.SCRIPT), "--ckpt", str(dirs[train_key] / "ckpt"),
                              "--buffer", str(dirs[buffer_key] / "buffer.jsonl"),
                              *spec.argv("max_len"), "--out", str(tmp / "buffer_stats.json"),
                              "--quiet"]
        return self.pipe.add("buffer-nll", f"s{stage}-buffer-nll", spec, [train_key, buffer_key],
                             build)
