"""train.py's resumable training state: what a state is keyed by (the flags that change the
weights), writing it whole or not at all, loading it only into the run it was saved for, and
--resume's checks (one line naming the flag that differs).

A state is OUT.partial/state/: the sharded model and optimizer through torch.distributed.checkpoint,
an EMA teacher's weights when there is one, and progress.pt (step, schedule, the plan id and the
settings it was saved with).
"""
import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import UserError
from common.jsonl import jsonl_lines
from common.outputs import check_output, claim_dir
from model.checkpoint import replace_dir

# flags that do not change the weights a run ends with; every other flag is part of the resume
# check, so a new flag is checked unless it is listed here
NOT_PLAN_ARGS = ("out", "resume", "quiet", "debug", "overwrite", "save_every", "peak_tflops",
                 "activation_checkpointing", "tensorboard", "wandb")
# ... nor the weights of a training state at a given step:
# the schedule spans the whole plan whatever --max-steps is
NOT_STATE_ARGS = NOT_PLAN_ARGS + ("max_steps",)


def _trained(load=False):
    """The state's model part holds the trained parameters only: a LoRA stage's frozen base is
    --model's, read again on resume, not a second copy per saved state (full fine-tuning freezes
    nothing: all of them). Loading, the frozen ones are absent by design (not strict); dcp.load has
    already required every saved one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=True, strict=not load)


# flags that name files or directories: a state holds what they contain, not where they were
# (fingerprint), so a run directory moved with a stage's saved state resumes, and other content
# under the same path does not
PATH_ARGS = ("model", "data", "memory", "lora_init")
FINGERPRINT_BYTES = 1 << 20  # read at each end of every file
# what of a checkpoint or adapter directory a fingerprint covers besides its weights: not
# train_summary.json (its wall times differ between two trainings to the same bytes) nor what later
# writers add beside it
CKPT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "adapter_config.json")


def fingerprint(paths: str) -> list:
    """What the files behind a path flag hold (comma-separated paths, as --data takes): per file
    its name, size and the sha256 of its first and last FINGERPRINT_BYTES; for a checkpoint or
    adapter directory, its top-level weights and CKPT_FILES. A path that is not there (a model id)
    stands for itself."""
    out = []
    for p in map(Path, str(paths).split(",")):
        if not p.exists():
            out.append(str(p))
            continue
        files = (sorted(f for f in p.iterdir()
                        if f.is_file() and (f.suffix == ".safetensors" or f.name in CKPT_FILES))
                 if p.is_dir() else [p])
        for f in files:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                h = hashlib.sha256(fh.read(FINGERPRINT_BYTES))
                if size > FINGERPRINT_BYTES:
                    fh.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                    h.update(fh.read())
            out.append([f.name, size, h.hexdigest()[:16]])
    return out


def state_settings(args) -> dict:
    """The flags a resumable training state depends on: all of them but NOT_STATE_ARGS and the
    other objectives' flags (which the run never reads), as JSON values; PATH_ARGS by what they
    hold (fingerprint)."""
    from methods import OBJECTIVES
    others = tuple(p for o in OBJECTIVES.values() if o.name != args.objective for p in o.prefixes)
    if not getattr(args, "lora_rank", 0):  # full fine-tuning reads no other LoRA flag
        others += ("lora_alpha", "lora_dropout", "lora_targets", "lora_init")
    return {k: fingerprint(v) if k in PATH_ARGS and v else json.loads(json.dumps(v))
            for k, v in vars(args).items()
            if k not in NOT_STATE_ARGS and not k.startswith(others)}


def plan_digest(settings: dict, examples: list) -> str:
    """What a resumable training state must have been saved for: the flags that change the weights
    (settings: state_settings) and the tokens of every example, with their loss mask and source (a
    data file edited between a save and a --resume, even to the same lengths, is another run)."""
    from array import array
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for e in examples:
        h.update(array("q", [len(e.ids), e.replay, *e.ids, *e.targets]).tobytes())
    return h.hexdigest()


def hold(workdir: Path, rank: int, device) -> int | None:
    """Make OUT.partial (train.py's own) and hold an exclusive flock on it for the rest of the run
    (rank 0), so that a second train.py on the same --out is refused in one line before it writes
    anything there (it has only read its inputs). Every rank learns whether rank 0 got it. -> the
    lock's fd (rank 0), to close when the run ends."""
    import fcntl
    import os
    fd, error = None, None
    # every rank has checked --out's directories (already_final) before rank 0 makes one of them
    dist.barrier()
    if rank == 0:
        try:
            claim_dir(workdir, "train-state")
            fd = os.open(workdir, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            error = UserError(f"--out {workdir.with_name(workdir.name.removesuffix('.partial'))}: "
                              f"another train.py is writing it ({workdir} is locked); "
                              f"wait for it to finish, or choose another --out")
    ok = torch.tensor(float(error is None), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise UserError("rank 0 could not lock --out's .partial directory (its error is above)")
    return fd


def final_with_same_settings(out: Path, args) -> bool:
    """--resume found a final checkpoint at OUT: True when it was trained with these settings
    (nothing to do); a UserError naming the first differing flag otherwise (resuming cannot turn it
    into another run)."""
    done = json.loads((out / "train_summary.json").read_text()).get("args", {})
    for k, v in vars(args).items():
        if k not in NOT_PLAN_ARGS and json.loads(json.dumps(v)) != done.get(k):
            raise UserError(f"{out} is already a final checkpoint, trained with "
                            f"--{k.replace('_', '-')} {done.get(k)!r} (now {v!r}); "
                            f"--resume only continues an unfinished run: "
                            f"drop --resume to retrain it, or choose another --out")
    return True


def saved_settings(workdir: Path) -> dict:
    """The flags a resumable training state in workdir was saved with ({} when there is none)."""
    try:
        return torch.load(workdir / "state" / "progress.pt",
                          weights_only=False).get("settings") or {}
    except Exception:  # no state, or an unreadable one (load_state says so, when --resume reads it)
        return {}


def save_state(model, opt, sched, step, workdir: Path, rank: int, plan_id: str, teacher=None,
               settings=None):
    """Resumable training state (sharded model + optimizer via torch.distributed.checkpoint,
    schedule, position, and an EMA teacher's weights when there is one), written to a temporary
    directory and renamed, so a crash never leaves a half-written state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    tmp, final = workdir / "state.tmp", workdir / "state"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt, options=_trained())
    state = {"model": msd, "optim": osd}
    if teacher is not None:
        state["teacher"] = get_model_state_dict(teacher)
    try:
        dcp.save(state, checkpoint_id=str(tmp))
        if rank == 0:
            torch.save({"step": step, "sched": sched.state_dict(), "plan": plan_id,
                        "settings": settings}, tmp / "progress.pt")
    except (Exception, CheckpointException) as e:  # a full disk, a quota, a file-size limit:
        if rank == 0:                              # torch says it without a path (its zip
                                                   # writer's RuntimeError, wrapped by dcp)
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"{tmp}: cannot write the training state ({_write_failure(e)}); "
            f"{'the last saved state ' + str(final) + ' is kept: ' if final.exists() else ''}"
            f"make room and re-run with --resume") from e
    if rank == 0:
        replace_dir(tmp, final)
    dist.barrier()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:200] if text else type(e).__name__)


def _write_failure(e: BaseException) -> str:
    """What went wrong in a failed save, in a few words: the OS error in its chain (dcp wraps each
    rank's), else the first line of the innermost error (torch's zip writer reports a short write as
    'unexpected pos', no errno)."""
    seen, todo, inner = set(), [e], None
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.strerror:
            return x.strerror
        # dcp's CheckpointException: {rank: (exception, traceback)}
        failures = getattr(x, "failures", None)
        if failures is None and inner is None:
            inner = x
        todo += [x.__cause__, x.__context__,
                 *(f[0] if isinstance(f, tuple) else f for f in (failures or {}).values())]
    return f"{_first_line(inner or e)}: a full disk, a quota or a file-size limit?"


def load_state(model, opt, sched, workdir: Path, plan_id: str, teacher=None, settings=None) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)

    state = workdir / "state"
    if not (state / "progress.pt").exists():
        return 0
    try:
        progress = torch.load(state / "progress.pt", weights_only=False)
        assert (isinstance(progress, dict)
                and isinstance(progress.get("step"), int)), "not train.py's progress record"
    except Exception as e:  # truncated or damaged
        raise UserError(f"{state / 'progress.pt'}: the saved training state cannot be read "
                        f"({_first_line(e)}); drop --resume to start over "
                        f"(or restore the state)") from e
    if progress.get("plan") != plan_id:
        saved = progress.get("settings") or {}
        diff = next((k for k in sorted(set(saved) | set(settings or {}))
                     if saved.get(k) != (settings or {}).get(k)), None)
        what = (f"--{diff.replace('_', '-')} holds other content than it did" if diff in PATH_ARGS
                else (f"--{diff.replace('_', '-')} was {saved.get(diff)!r}, "
                      f"now {(settings or {}).get(diff)!r}") if diff
                else "the flags match but the data's content or length filter differ" if saved
                else "it predates the per-flag check")
        raise UserError(f"{state} was saved for a different run ({what}); refusing to --resume "
                        f"from it: drop --resume to start over, or choose another --out")
    msd, osd = get_state_dict(model, opt, options=_trained())
    sd = {"model": msd, "optim": osd}
    if teacher is not None:
        sd["teacher"] = get_model_state_dict(teacher)
    try:
        dcp.load(sd, checkpoint_id=str(state))
    except (Exception, CheckpointException) as e:  # a shard truncated, removed or edited
                                                   # since it was saved
        raise UserError(f"{state}: the saved training state cannot be read ({_first_line(e)}); "
                        f"drop --resume to start over (or restore the state)") from e
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd,
                   options=_trained(load=True))
    if teacher is not None:
        set_model_state_dict(teacher, sd["teacher"])
    sched.load_state_dict(progress["sched"])
    return progress["step"]


def resume(args, rank, model, opt, sched, workdir: Path, plan_id: str, ema_teacher, settings,
           total_steps) -> int:
    """The first step to run: 0, or with --resume where the saved state in workdir stopped (loaded
    into model, optimizer, schedule and EMA teacher); the log is cut to match."""
    start = 0
    if rank == 0:
        claim_dir(workdir, "train-state")
    dist.barrier()
    if args.resume:
        start = load_state(model, opt, sched, workdir, plan_id, ema_teacher, settings)
        if start and rank == 0:
            print(f"train.py: resumed at step {start} of {total_steps} from {workdir / 'state'}",
                  flush=True)
    if rank == 0:  # keep the log consistent with the state we resume from
        log_path = workdir / "train_log.jsonl"
        kept = [l for l in (jsonl_lines(log_path.read_text())
                            if log_path.exists() and start else [])
                # a kill can cut the last line short
                if l.endswith("}") and json.loads(l)["step"] <= start]
        log_path.write_text("".join(l + "\n" for l in kept))
    return start


def already_final(args, rank: int, out: Path, workdir: Path) -> bool:
    """True when --resume finds OUT already the final checkpoint of these settings (said on rank 0:
    nothing to do); otherwise OUT and its .partial directory are checked as outputs (only train.py's
    own are replaced)."""
    if out.resolve() == Path(args.model).resolve():
        raise UserError(f"--out {out}: is --model's checkpoint; train.py would replace its own "
                        f"input with its fine-tune: choose another --out")
    if args.resume and not (workdir / "state").exists() and (out / "train_summary.json").is_file():
        if final_with_same_settings(out, args):
            if rank == 0:
                print(f"train.py: {out} is already the final checkpoint of these settings; nothing "
                      f"to resume", flush=True)
            return True
    check_output(out, "checkpoint", args.overwrite)  # replace only an earlier
                                                     # checkpoint of train.py
    check_output(workdir, "train-state", args.overwrite, flag="--out (its .partial directory)")
    return False
