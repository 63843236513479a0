"""model/train_state.py: which flags key a resumable training state. (Saving, resuming and refusing a state of
another run are tested end to end through train.py in tests/test_train.py.)"""
from model import train_state
import train as train_script


def test_state_settings_are_every_flag_but_the_listed_ones():
    args = train_script.parse_args(["--objective", "sft-kl"])
    got = train_state.state_settings(args)
    assert "weight_decay" in got and "sft_kl_beta" in got and "sdft_alpha" not in got and "max_steps" not in got
    assert got["lr_schedule"] == "cosine"  # the schedule changes the weights: a state of another one is refused
    from methods import OBJECTIVES
    others = tuple(p for o in OBJECTIVES.values() if o.name != "sft-kl" for p in o.prefixes)  # sdft_, ewc_, lwf_, ...
    others += ("lora_alpha", "lora_dropout", "lora_targets", "lora_init")
    assert set(got) | set(train_state.NOT_STATE_ARGS) | {k for k in vars(args) if k.startswith(others)} \
        == set(vars(args))
    assert not {k for k in got if k.startswith(others)}  # the other objectives' flags are no part of the state
    assert "ewc_lambda" in train_state.state_settings(train_script.parse_args(["--objective", "ewc"]))
    lora = ("lora_alpha", "lora_dropout", "lora_targets", "lora_init")  # read only by a LoRA stage
    assert got["lora_rank"] == 0 and not set(lora) & set(got)
    assert set(lora) <= set(train_state.state_settings(train_script.parse_args(["--lora-rank", "4"])))
