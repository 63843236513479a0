"""train.py — one continual-learning stage: supervised fine-tuning of a checkpoint on a data mixture.

    torchrun --nproc_per_node 8 train.py --model DIR --data task.jsonl,buffer.jsonl --out DIR
    python train.py ...                      (one process)
    torchrun --nproc_per_node 8 train.py     (no flags: the embedded benchmark's first task on the tiny base)

The algorithm, top to bottom:
  1. tokenize the mixture with the model's chat template; loss only on the response (+ end-of-turn token);
     examples longer than --max-len are dropped and counted, never truncated
  2. build the model on `meta`, FSDP2-shard each block and then the root, materialise, load the weights
     (each rank reads only its own rows)
  3. each optimizer step takes --global-batch sequences (seeded shuffle per epoch), packs them into
     micro-batches of at most --micro-tokens tokens with no padding, and accumulates gradients of
         sum of response-token NLL / number of response tokens in the whole step (all ranks)
     so gradients do not depend on world size, micro-batch split or packing
  4. AdamW, cosine decay to 0 with no warmup, grad-norm clip; optional SDFT term beta * KL to an EMA teacher
  5. periodic resumable training state; final weights as a Hugging Face checkpoint directory (--out)

Records that carry a "source" field (the replay buffers score.py and run.py write) are replay examples, the others
the stage's own task examples; when the mixture has both, each step's log also holds loss_task and loss_replay (each
source's NLL per response token of that source) and target_tokens_replay, so that
    loss * target_tokens == loss_task * (target_tokens - target_tokens_replay) + loss_replay * target_tokens_replay
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from data.cli import InputError, Parser, UserError, float_in, int_at_least, main_cli
from data.jsonl import check_output, read_records
from data.packing import collate, pack, plan_steps, tokenize_sft
from kernels import attention, cross_entropy
from model.checkpoint import load_config, load_into, replace_dir, save_checkpoint
from model.tokenizer import ChatTokenizer
from model.transformer import Transformer

# ---- defaults: the paper's hyperparameters (7-8B models, 8xH100) ------------------------------------------
LR = 1e-5                # AdamW, cosine to 0, no warmup
WEIGHT_DECAY = 0.0
BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0
GLOBAL_BATCH = 128       # sequences per optimizer step
MAX_LEN = 2048           # longer examples are dropped
EPOCHS = 5               # per stage; TRACE order uses [5, 3, 7, 5, 3, 5, 5, 7]
MICRO_TOKENS = 16384     # tokens per packed micro-batch (per rank)
SAVE_EVERY = 50          # optimizer steps between resumable training states (0: never)
SDFT_BETA = 0.0          # > 0 turns on the SDFT baseline: + beta * per-token KL to an EMA teacher
SDFT_EMA = 0.99
SDFT_KL = "reverse"      # KL(student || teacher); "forward" = KL(teacher || student)
# ------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="input checkpoint (HF directory); default: the tiny embedded base model")
    p.add_argument("--data", help="comma-separated JSONL/JSON files of {prompt, response} (or TRACE's "
                                  "{prompt, answer}); default: the embedded benchmark's first task")
    p.add_argument("--out", default="runs/train-default", help="output checkpoint directory (default: %(default)s); "
                   "an earlier checkpoint of train.py there is replaced, anything else is refused")
    p.add_argument("--overwrite", action="store_true", help="replace whatever is at --out, even if train.py did "
                                                           "not write it")
    p.add_argument("--epochs", type=int_at_least(1), default=EPOCHS, help="epochs over the mixture (default: %(default)s)")
    p.add_argument("--lr", type=float_in(0, lo_open=True), default=LR, help="peak learning rate (default: %(default)s)")
    p.add_argument("--weight-decay", type=float_in(0), default=WEIGHT_DECAY, help="(default: %(default)s)")
    p.add_argument("--betas", type=float_in(0, 1), nargs=2, default=BETAS, help="AdamW betas (default: %(default)s)")
    p.add_argument("--grad-clip", type=float_in(0, lo_open=True), default=GRAD_CLIP, help="max grad norm (default: %(default)s)")
    p.add_argument("--global-batch", type=int_at_least(1), default=GLOBAL_BATCH, help="sequences per step (default: %(default)s)")
    p.add_argument("--max-len", type=int_at_least(2), default=MAX_LEN, help="drop longer examples (default: %(default)s)")
    p.add_argument("--micro-tokens", type=int_at_least(1), default=MICRO_TOKENS,
                   help="token budget of one packed micro-batch (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="data order seed (default: %(default)s)")
    p.add_argument("--save-every", type=int_at_least(0), default=SAVE_EVERY,
                   help="steps between resumable training states, 0 = never (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from the last training state in OUT.partial/; "
                   "when OUT is already the final checkpoint of the same settings, say so and exit 0")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="compute dtype: auto = bf16 on CUDA (fp32 master weights), fp32 on CPU")
    p.add_argument("--sdft-beta", type=float_in(0), default=SDFT_BETA, help="SDFT KL weight, 0 = off (default: %(default)s)")
    p.add_argument("--sdft-ema", type=float_in(0, 1), default=SDFT_EMA, help="EMA decay of the SDFT teacher (default: %(default)s)")
    p.add_argument("--sdft-kl", choices=["reverse", "forward"], default=SDFT_KL, help="KL direction (default: %(default)s)")
    p.add_argument("--peak-tflops", type=float_in(0, lo_open=True), help="device peak for the MFU estimate (default: H100 bf16 dense "
                                                     "on CUDA, a measured fp32 matmul on CPU)")
    p.add_argument("--max-steps", type=int_at_least(1), help="stop after this many optimizer steps (for smoke tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


# flags that do not change the weights a run ends with
NOT_PLAN_ARGS = ("out", "resume", "quiet", "debug", "overwrite", "save_every", "peak_tflops", "activation_checkpointing")


def final_with_same_settings(out: Path, args) -> bool:
    """--resume found a final checkpoint at OUT: True when it was trained with these settings (nothing to do);
    a UserError naming the first differing flag otherwise (resuming cannot turn it into another run)."""
    done = json.loads((out / "train_summary.json").read_text()).get("args", {})
    for k, v in vars(args).items():
        if k not in NOT_PLAN_ARGS and json.loads(json.dumps(v)) != done.get(k):
            raise UserError(f"{out} is already a final checkpoint, trained with --{k.replace('_', '-')} "
                            f"{done.get(k)!r} (now {v!r}); --resume only continues an unfinished run: drop --resume "
                            f"to retrain it, or choose another --out")
    return True


def setup_distributed():
    """One code path for every launch: under torchrun its env:// rendezvous; as a plain process, a world of one
    with an in-process store (no TCP port, so parallel single-process runs can never join each other)."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        local_rank = 0
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def load_mixture(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        for r in read_records(path, required=("prompt",), any_of=("response", "answer")):
            response = r["response"] if isinstance(r.get("response"), str) else r["answer"]
            # a record with a "source" (score.py's buffers, run.py's gold replay) is replay: its loss is logged apart
            records.append({"prompt": r["prompt"], "response": response, "replay": "source" in r})
    return records


def build_model(ckpt_dir, device, compute_dtype, activation_checkpointing=False):
    """meta -> fully_shard(each block) -> fully_shard(root) -> materialise -> load. lm_head and the final norm
    stay in the root unit, where forward computes the loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Transformer(load_config(ckpt_dir))
    model.activation_checkpointing = activation_checkpointing
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    world = dist.get_world_size()
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp, reshard_after_forward=world > 1)  # one rank: nothing to free
    fully_shard(model, mp_policy=mp)
    # Gradients are summed across ranks (our loss is already divided by the global token count); gloo has no
    # PREMUL_SUM, so force a plain sum everywhere.
    for m in [*model.model.layers, model]:
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(1.0)
    model.to_empty(device=device)
    load_into(model, ckpt_dir)
    return model


def replay_split(examples, device):
    """How a micro-batch's NLL splits by source: (None, 0) or (None, 1) when all its examples are task (0) or replay
    (1) examples, else (a [1,T] bool mask of the replay tokens, None), so that only mixed micro-batches pay for it."""
    flags = {e.replay for e in examples}
    if len(flags) < 2:
        return None, int(flags.pop()) if flags else 0
    mask = torch.tensor([e.replay for e in examples for _ in e.ids], dtype=torch.bool, device=device)[None]
    return mask, None


def cosine(step: int, total: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(step, total) / max(total, 1)))


def measured_peak_flops(device, dtype) -> float:
    if device.type == "cuda":  # H100 SXM dense: bf16 tensor cores, or TF32 for fp32 matmuls
        return 989e12 if dtype == torch.bfloat16 else 495e12
    a = torch.randn(1024, 1024)
    a @ a
    t = time.perf_counter()
    for _ in range(8):
        a @ a
    return 8 * 2 * 1024**3 / (time.perf_counter() - t)


def save_state(model, opt, sched, step, workdir: Path, rank: int, plan_id: str):
    """Resumable training state (sharded model + optimizer via torch.distributed.checkpoint, schedule, position),
    written to a temporary directory and renamed, so a crash never leaves a half-written state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, final = workdir / "state.tmp", workdir / "state"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    if rank == 0:
        torch.save({"step": step, "sched": sched.state_dict(), "plan": plan_id}, tmp / "progress.pt")
        replace_dir(tmp, final)
    dist.barrier()


def load_state(model, opt, sched, workdir: Path, plan_id: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = workdir / "state"
    if not (state / "progress.pt").exists():
        return 0
    progress = torch.load(state / "progress.pt", weights_only=False)
    if progress.get("plan") != plan_id:
        raise UserError(f"{state} was saved for a different run (data, epochs, batch, seed, lr or "
                         f"max length differ); refusing to --resume from it")
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(state))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    sched.load_state_dict(progress["sched"])
    return progress["step"]


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    compute_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.model is None or args.data is None:
        from data.embedded import ensure_embedded
        from model.base import ensure_base
        if rank == 0:  # built once, cached; the other ranks wait
            args.model = args.model or str(ensure_base("tiny"))
            args.data = args.data or str(ensure_embedded() / "C-STANCE" / "train.json")
        dist.barrier()
        args.model = args.model or str(ensure_base("tiny"))
        args.data = args.data or str(ensure_embedded() / "C-STANCE" / "train.json")
    out = Path(args.out)
    workdir = out.with_name(out.name + ".partial")  # training state and logs until the checkpoint is final
    log_path = workdir / "train_log.jsonl"
    if args.resume and not (workdir / "state").exists() and (out / "train_summary.json").is_file():
        if final_with_same_settings(out, args):
            if rank == 0:
                print(f"train.py: {out} is already the final checkpoint of these settings; nothing to resume",
                      flush=True)
            dist.destroy_process_group()
            return 0
    check_output(out, "checkpoint", args.overwrite)  # replace only an earlier checkpoint of train.py
    check_output(workdir, "train-state", args.overwrite, flag="--out (its .partial directory)")

    # 1. data: every rank tokenizes the same mixture and plans the same steps
    tok = ChatTokenizer.from_dir(args.model)
    examples, dropped = tokenize_sft(load_mixture(args.data.split(",")), tok, args.max_len)
    if not examples:
        raise InputError(f"no example of {args.data} fits --max-len {args.max_len}")
    lengths = [len(e.ids) for e in examples]
    has_replay = 0 < sum(e.replay for e in examples) < len(examples)  # log the loss per source
    steps = plan_steps(len(examples), args.global_batch, args.epochs, args.seed)
    total_steps = len(steps)  # the schedule always spans the whole plan, also when --max-steps stops early
    if args.max_steps is not None:
        steps = steps[:args.max_steps]
    plan_id = hashlib.sha256(json.dumps([args.data, lengths, args.epochs, args.global_batch, args.seed, args.lr,
                                         args.max_len]).encode()).hexdigest()

    # 2. model (and the SDFT teacher, an EMA copy of the student)
    model = build_model(args.model, device, compute_dtype, args.activation_checkpointing)
    teacher = build_model(args.model, device, compute_dtype) if args.sdft_beta > 0 else None
    if teacher is not None:
        teacher.requires_grad_(False)

    # 3. optimizer and schedule
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay,
                            foreach=True)  # one kernel per op over all tensors: less per-step overhead
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, total_steps))
    start = 0
    if rank == 0:
        workdir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if args.resume:
        start = load_state(model, opt, sched, workdir, plan_id)
        if teacher is not None and start:
            raise UserError("--resume with SDFT is not supported (the EMA teacher is not checkpointed); run "
                            "without --resume")
    if rank == 0:  # keep the log consistent with the state we resume from
        kept = [l for l in (log_path.read_text().splitlines() if log_path.exists() and start else [])
                if l.endswith("}") and json.loads(l)["step"] <= start]  # a kill can cut the last line short
        log_path.write_text("".join(l + "\n" for l in kept))

    cfg = model.cfg
    peak = (args.peak_tflops * 1e12) if args.peak_tflops else measured_peak_flops(device, compute_dtype)
    mean_doc = sum(lengths) / len(lengths)
    flops_per_token = 6 * cfg.num_params(embeddings=False) + 6 * cfg.vocab_size * cfg.hidden_size \
        + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * mean_doc
    if rank == 0:
        n_tok = sum(lengths)
        print(f"train.py: {len(examples)} examples ({dropped} longer than {args.max_len} dropped), {n_tok} tokens, "
              f"{len(steps)} steps of <= {args.global_batch} sequences on {world} rank(s), {device.type}, "
              f"{str(compute_dtype).removeprefix('torch.')}", flush=True)
        print(f"train.py: kernels: attention {attention.describe()}; cross-entropy {cross_entropy.get_backend()}",
              flush=True)

    # 4. the loop
    bar = tqdm(total=len(steps), initial=start, disable=rank != 0 or args.quiet, desc="train", unit="step")
    t_start, tokens_seen, packed_tokens, packed_slots = time.perf_counter(), 0, 0, 0
    for step in range(start, len(steps)):
        t0 = time.perf_counter()
        batch = steps[step]
        n_targets = sum(examples[i].n_targets for i in batch)  # the global token count: every rank plans it
        micro = pack(batch, lengths, args.micro_tokens, world)[rank]
        packed_tokens += sum(lengths[i] for mb in micro for i in mb)
        packed_slots += len(micro) * args.micro_tokens
        nll_sum = torch.zeros((), device=device)
        kl_sum = torch.zeros((), device=device)
        src_sum = torch.zeros(2, device=device)  # NLL sums of task and replay examples
        for mb in micro:
            ids, pos, tgt, cu, max_len = collate([examples[i] for i in mb], device)
            kw = dict(cu_seqlens=cu, max_seqlen=max_len)
            mask, slot = replay_split([examples[i] for i in mb], device) if has_replay else (None, 0)
            if teacher is None:
                nll = model(ids, pos, labels=tgt, replay_mask=mask, **kw)
            else:
                with torch.no_grad():
                    t_hidden = teacher(ids, pos, return_hidden=True, **kw)[tgt != -100]
                # FSDP leaves the root unit (lm_head) unsharded after a forward, so its full weight is at hand;
                # the student computes both sides' log-probs chunk by chunk
                t_weight = teacher.lm_head.weight
                nll, kl = model(ids, pos, labels=tgt, teacher=(t_hidden, t_weight), kl_direction=args.sdft_kl,
                                replay_mask=mask, **kw)
                kl_sum += kl.detach()
            if mask is None:
                src_sum[slot] += nll.detach()
            else:  # a micro-batch of both sources: the forward returned (task, replay) sums
                src_sum += nll.detach()
                nll = nll.sum()
            loss = nll if teacher is None else nll + args.sdft_beta * kl
            (loss / max(n_targets, 1)).backward()
            nll_sum += nll.detach()
        sums = torch.cat([torch.stack([nll_sum, kl_sum]), src_sum])
        dist.all_reduce(sums)
        train_loss, kl_mean, task_nll, replay_nll = (sums / max(n_targets, 1)).tolist()
        if not math.isfinite(train_loss):
            raise UserError(f"non-finite loss {train_loss} at step {step + 1}; stopping. The last good "
                             f"training state (if any) is intact in {workdir / 'state'}")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).full_tensor().item()
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if teacher is not None:
            # a forward with no backward can leave the teacher's units (always the root: embeddings, norm, lm_head)
            # unsharded, as plain tensors: reshard so the EMA below updates the sharded parameters
            for unit in [*teacher.model.layers, teacher]:
                unit.reshard()
            with torch.no_grad():
                for t_p, s_p in zip(teacher.parameters(), model.parameters()):
                    t_p.lerp_(s_p, 1 - args.sdft_ema)

        step_tokens = sum(lengths[i] for i in batch)
        tokens_seen += step_tokens
        dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": train_loss, "grad_norm": grad_norm, "lr": lr, "tokens": step_tokens,
                  "target_tokens": n_targets, "tokens_per_s": step_tokens / dt,
                  "mfu": step_tokens * flops_per_token / dt / peak / world}
        if teacher is not None:
            record["kl"] = kl_mean
        if has_replay:  # per source: that source's NLL per response token of that source
            n_replay = sum(examples[i].n_targets for i in batch if examples[i].replay)
            record["loss_task"] = task_nll * n_targets / (n_targets - n_replay) if n_targets > n_replay else None
            record["loss_replay"] = replay_nll * n_targets / n_replay if n_replay else None
            record["target_tokens_replay"] = n_replay
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update()
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < len(steps):
            save_state(model, opt, sched, step + 1, workdir, rank, plan_id)
    bar.close()

    # 5. final weights: gather the full state dict to rank 0 and write a Hugging Face checkpoint directory
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elapsed = time.perf_counter() - t_start
    # rank 0 writes; every rank learns whether that worked, so none waits forever on a failed rank 0
    error = None
    if rank == 0:
        try:
            summary = {"steps": len(steps), "examples": len(examples), "dropped_overlong": dropped,
                       "tokens": sum(lengths[i] for batch in steps for i in batch), "trained_tokens_this_run": tokens_seen,
                       "seconds": elapsed, "tokens_per_s": tokens_seen / max(elapsed, 1e-9),
                       "packing_efficiency": packed_tokens / max(packed_slots, 1),
                       "world_size": world, "args": vars(args)}
            (workdir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            save_dtype = torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32
            save_checkpoint(full, args.model, out, dtype=save_dtype,
                            extra_files=[log_path, workdir / "train_summary.json"])
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"train.py: {len(steps)} steps, {tokens_seen} tokens in {elapsed:.1f}s "
                  f"({summary['tokens_per_s']:.0f} tok/s), dropped {dropped} over-long, packing efficiency "
                  f"{summary['packing_efficiency']:.1%} -> {out}", flush=True)
        except Exception as e:  # re-raised below, after the other ranks heard of it
            error = e
    ok = torch.tensor(float(error is None), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise UserError("rank 0 failed to write the final checkpoint (its error is above)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_cli(main, "train.py")
