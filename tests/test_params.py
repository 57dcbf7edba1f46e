"""gpuplane/params.py: a run's hyperparameters, told apart from paths and bookkeeping."""
from gpuplane import params
from gpuplane.semantic import config_diff


def test_every_spelling_of_a_flag_and_hydra_overrides():
    p, other = params.split({"command": [
        "python", "-u", "train.py", "--lr", "0.5", "--epochs=4", "--amp", "--weight-decay",
        "1e-4", "model.depth=4", "+optim=adam", "~trainer.logger", "--name", "lr-0.5"]})
    assert p == {"lr": 0.5, "epochs": 4, "amp": True, "weight_decay": 1e-4,
                 "model.depth": 4, "optim": "adam"}
    assert other == {"name": "lr-0.5"}


def test_paths_and_bookkeeping_are_not_hyperparameters():
    p, other = params.split({"command": [
        "python", "train.py", "--lr=0.1", "--logdir", "runs/a", "--checkpoint-dir", "ckpt",
        "--data", "/data/mnist", "--num-workers", "4", "--device", "cuda", "--init",
        "./warm.pt", "--batch-size", "64", "--log-every", "10"]})
    assert p == {"lr": 0.1, "batch_size": 64}
    assert set(other) == {"logdir", "checkpoint_dir", "data", "num_workers", "device", "init",
                          "log_every"}


def test_a_trials_sweep_entry_is_bookkeeping():
    p, other = params.split({"lr": 0.1, "sweep": {"id": 1, "trial": 2}})
    assert p == {"lr": 0.1} and other == {"sweep": {"id": 1, "trial": 2}}


def test_the_sdk_config_wins_and_joins_the_command_line():
    p, _ = params.split({"command": ["python", "t.py", "lr=0.1", "--seed", "3"],
                         "lr": 0.2, "hidden": 128, "out_dir": "/tmp/x"})
    assert p == {"lr": 0.2, "seed": 3, "hidden": 128}


def test_settings_that_differ_leave_bookkeeping_out():
    runs = [{"id": i, "config": {"command": ["python", "t.py", "--lr", lr, "--logdir",
                                             f"runs/{lr}", "--checkpoint-dir", f"ck/{lr}"]}}
            for i, lr in ((1, "0.5"), (2, "0.05"))]
    assert config_diff(runs) == {"lr": {"1": 0.5, "2": 0.05}}
