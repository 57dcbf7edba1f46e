"""Optuna's TPE against random search on a real training objective (issue 35).

    .venv/bin/python bench/sampler_tpe.py [--trials 100] [--seeds 5] [--epochs 200]

The objective is a small PyTorch MLP (one hidden layer of `width` units, tanh) trained
full-batch with AdamW on a fixed synthetic regression task (a noisy sum of sines of 4
inputs, noise sd 0.3, 512 training and 512 validation points); its value is the validation MSE after
`--epochs` steps. The parameters are those a sweep would give: learning rate (log
1e-4..1), width (int 4..128) and weight decay (log 1e-6..1). The same data and the same
initial weights (torch seed 0) for every evaluation: the objective is a deterministic
function of the parameters, the same for both samplers, so evaluations are cached by
parameters.

For each seed, a TPE study and a random study are driven by ask/tell, as GPUPlane's
sweeper drives them, for `--trials` trials each: the samplers are made by
gpuplane/samplers.py's table (what `sampler = "tpe"` and `"random"` get) and the space is
what a sweep's [parameters] map to there. Printed
per seed: the best value each found, and the number of trials each needed to come within
1 % of the best value either found (a study that never did counts as trials + 1, a lower
bound, marked '>'), and the trials TPE needed to be as good as random search's best (found
at the trial in brackets). Then the median over seeds of the ratio TPE / random (the goal is
≤ 0.7×), and each sampler's median best value so far at a quarter, half and all of the
trials. Figures are in docs/benchmarks.md.
"""
import argparse
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

LR = (1e-4, 1.0)
WIDTH = (4, 128)
WD = (1e-6, 1.0)
WITHIN = 0.01
PARAMETERS = {"lr": {"type": "log_uniform", "low": LR[0], "high": LR[1]},
              "width": {"type": "int_uniform", "low": WIDTH[0], "high": WIDTH[1]},
              "wd": {"type": "log_uniform", "low": WD[0], "high": WD[1]}}


DIMS, NOISE = 4, 0.3


def make_task():
    import torch
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(1024, DIMS, generator=g) * 4 - 2
    w = torch.randn(DIMS, generator=g)
    y = (torch.sin(x * w).sum(1, keepdim=True) + 0.3 * torch.cos(3 * x[:, :1])
         + NOISE * torch.randn(1024, 1, generator=g))
    return x[:512], y[:512], x[512:], y[512:]


class Objective:
    def __init__(self, epochs):
        import torch
        torch.set_num_threads(2)
        self.torch = torch
        self.epochs = epochs
        self.task = make_task()
        self.cache = {}
        self.evaluated = 0
        self.seconds = 0.0

    def __call__(self, lr, width, wd):
        key = (lr, width, wd)
        if key not in self.cache:
            t0 = time.perf_counter()
            self.cache[key] = self.train(lr, width, wd)
            self.seconds += time.perf_counter() - t0
            self.evaluated += 1
        return self.cache[key]

    def train(self, lr, width, wd):
        torch = self.torch
        xt, yt, xv, yv = self.task
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(DIMS, width), torch.nn.Tanh(),
                                    torch.nn.Linear(width, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
        for _ in range(self.epochs):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xt), yt)
            loss.backward()
            opt.step()
        with torch.no_grad():
            v = torch.nn.functional.mse_loss(model(xv), yv).item()
        return v if math.isfinite(v) else 1e6     # a diverged run is a very bad value


def run_study(name, seed, objective, trials):
    import optuna
    from gpuplane import samplers
    space = samplers.distributions({}, PARAMETERS)
    sampler = samplers.SAMPLERS[name][1](optuna, seed, {})
    study = optuna.create_study(sampler=sampler, direction="minimize",
                                storage=optuna.storages.InMemoryStorage())
    values = []
    for _ in range(trials):
        trial = study.ask(space)
        v = objective(trial.params["lr"], trial.params["width"], trial.params["wd"])
        study.tell(trial, v)
        values.append(v)
    return values


def trials_to_reach(values, target):
    best = math.inf
    for i, v in enumerate(values, 1):
        best = min(best, v)
        if best <= target:
            return i, True
    return len(values) + 1, False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=200, help="training steps per evaluation")
    args = ap.parse_args(argv)
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    objective = Objective(args.epochs)
    t0 = time.perf_counter()
    print(f"objective: MLP val MSE after {args.epochs} full-batch AdamW steps; lr log "
          f"{LR}, width int {WIDTH}, wd log {WD}; {args.trials} trials a study")
    print(f"{'seed':>4}  {'best tpe':>10}  {'best random':>11}  {'tpe n':>6}  "
          f"{'random n':>8}  {'ratio':>6}  {'tpe to random best':>18}")
    ratios, curves = [], {"tpe": [], "random": []}
    for seed in range(args.seeds):
        tpe = run_study("tpe", seed, objective, args.trials)
        rnd = run_study("random", seed, objective, args.trials)
        curves["tpe"].append(tpe)
        curves["random"].append(rnd)
        target = min(min(tpe), min(rnd)) * (1 + WITHIN)
        (nt, ok_t), (nr, ok_r) = trials_to_reach(tpe, target), trials_to_reach(rnd, target)
        ratio = nt / nr
        ratios.append(ratio)
        # how soon TPE is as good as random search's best of all its trials
        nm, ok_m = trials_to_reach(tpe, min(rnd))
        rbest = rnd.index(min(rnd)) + 1
        print(f"{seed:>4}  {min(tpe):>10.5f}  {min(rnd):>11.5f}  "
              f"{('' if ok_t else '>') + str(nt):>6}  {('' if ok_r else '>') + str(nr):>8}  "
              f"{ratio:>6.2f}  {('' if ok_m else '>') + str(nm):>8} (random {rbest:>3})")
    marks = sorted({max(1, args.trials // 4), max(1, args.trials // 2), args.trials})
    for name, runs in curves.items():
        said = ", ".join(f"{statistics.median(min(r[:m]) for r in runs):.5f} after {m}"
                         for m in marks)
        print(f"median best so far, {name}: {said}")
    med = statistics.median(ratios)
    print(f"median trials to within {WITHIN:.0%} of the best, TPE / random: {med:.2f}x "
          f"(goal <= 0.7x: {'met' if med <= 0.7 else 'not met'})")
    print(f"{objective.evaluated} trainings, {objective.seconds:.1f} s of training, "
          f"{time.perf_counter() - t0:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
