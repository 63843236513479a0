"""pipeline/train_state.py: which flags key a resumable training state. (Saving, resuming and refusing a state of
another run are tested end to end through train.py in tests/test_train.py.)"""
from pipeline import train_state
import train as train_script


def test_state_settings_are_every_flag_but_the_listed_ones():
    args = train_script.parse_args(["--objective", "sft-kl"])
    got = train_state.state_settings(args)
    assert "weight_decay" in got and "sft_kl_beta" in got and "sdft_alpha" not in got and "max_steps" not in got
    assert got["lr_schedule"] == "cosine"  # the schedule changes the weights: a state of another one is refused
    assert set(got) | set(train_state.NOT_STATE_ARGS) | {k for k in vars(args) if k.startswith(("sdft_", "ewc_"))} \
        == set(vars(args))
    assert "ewc_lambda" in train_state.state_settings(train_script.parse_args(["--objective", "ewc"]))
