"""Optuna behind a sweep (docs/sweeps.md, "Samplers").

A sweep that names a `sampler` gets its trials' parameters from an Optuna study: the
Sweeper thread asks the study when it launches a trial (so later trials learn from
earlier ones) and tells it the trial's result when the trial's job ends. Optuna's pruners
(`early_stopping = {rule = "optuna-median"}` or `"hyperband"`) are fed the trials'
intermediate values from the metric store in the same early-stopping pass as the built-in
rules. Optuna is an optional extra, imported here only, and only for a sweep that asks
for it: without it such a sweep is refused at create with the install line.

The study lives in memory (InMemoryStorage); GPUPlane's database is the source of truth.
A study not in memory (the server restarted, or a failed trial is re-run) is rebuilt by
replaying the sweep's asked trials in their order: each is enqueued with its stored
parameters and asked, and its relative sample drawn (and dropped), so the sampler's own
state (CMA-ES's generations, QMC's place in its sequence) advances as it did, then told
its stored result; those still running stay asked. The grid sampler is asked plainly instead (its trial N is grid point N of its
seeded shuffle, which the replay checks). A replay does not draw, so a sampler seeded as
before would draw again what it drew before the restart: a rebuilt TPE, CMA-ES or random
sampler is seeded from the sweep's seed and the number of trials replayed (grid and QMC
keep the seed: their place in the shuffle or the sequence is what the replay restores).
No SQL here: the Sweeper hands rows and curves.

Contents: the tables (SAMPLERS, PRUNERS), checks at create, the distributions, a trial's
outcome from its job and curve, and `Studies`, the sweeps' studies.
"""
import importlib
import logging
import threading
import warnings

from . import pruning

log = logging.getLogger(__name__)

INSTALL = "pip install 'gpuplane[optuna]'"


class SamplerError(ValueError):
    """A sampler or pruner spec that cannot run; the message names the fix."""


def _optuna(what):
    """The optuna module, quiet; SamplerError with the install line when it is missing."""
    try:
        optuna = importlib.import_module("optuna")
    except ImportError:
        raise SamplerError(f"{what} needs Optuna, an optional extra that is not installed "
                           f"on the server: {INSTALL} (in the server's environment), then "
                           "restart the server; or drop it for the built-in draws") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


# -- the samplers: name -> (the module beyond optuna it needs, the factory) ---------------

RESEEDED = ("tpe", "cmaes", "random")       # seeded anew when rebuilt (module docstring)


def rebuilt_seed(seed, replayed):
    return seed if not replayed else (seed * 1_000_003 + replayed * 7919) % 2**32

def _grid_space(grid):
    return {name: list(values) for name, values in grid.items()}


SAMPLERS = {
    # Tree-structured Parzen Estimator; running trials are given a "constant liar" value
    # (Optuna's default) so parallel asks spread out
    "tpe": (None, lambda o, seed, grid: o.samplers.TPESampler(seed=seed)),
    # CMA-ES over the numeric parameters (choices and grid lists are drawn at random)
    "cmaes": ("cmaes", lambda o, seed, grid: o.samplers.CmaEsSampler(
        seed=seed, warn_independent_sampling=False)),
    # scrambled Sobol points: a low-discrepancy cover of the space
    "qmc": ("scipy", lambda o, seed, grid: o.samplers.QMCSampler(
        seed=seed, scramble=True, warn_independent_sampling=False,
        warn_asynchronous_seeding=False)),
    "random": (None, lambda o, seed, grid: o.samplers.RandomSampler(seed=seed)),
    # every grid combination once, in a seeded shuffle
    "grid": (None, lambda o, seed, grid: o.samplers.GridSampler(_grid_space(grid), seed=seed)),
}

# Optuna's pruners as early-stopping rules: name -> {option: (default, lowest)} and the
# factory. The built-in rules (median, asha) are gpuplane/pruning.py's.
PRUNERS = {
    "optuna-median": ({"warmup_steps": (0, 0), "min_trials": (5, 0)},
                      lambda o, es: o.pruners.MedianPruner(
                          n_startup_trials=es["min_trials"],
                          n_warmup_steps=es["warmup_steps"])),
    "hyperband": ({"min_steps": (1, 1), "max_steps": ("auto", 1), "eta": (3, 2)},
                  lambda o, es: o.pruners.HyperbandPruner(
                      min_resource=es["min_steps"], max_resource=es["max_steps"],
                      reduction_factor=es["eta"])),
}

DIRECTIONS = {"min": "minimize", "max": "maximize"}


def parse_sampler(name, grid, rand):
    """The sampler of a create body, checked: its name, or None for the built-in draws."""
    if name is None:
        return None
    if name not in SAMPLERS:
        raise SamplerError(f"'sampler' must be one of {', '.join(SAMPLERS)}, got {name!r}; "
                           "or leave it out for the parameters drawn at create")
    if name == "grid" and rand:
        raise SamplerError(
            "a grid sampler takes only grid lists; parameter(s) "
            f"{', '.join(sorted(rand))} are random draws: make them lists "
            "(lr = [0.1, 0.01]) or use sampler = \"tpe\" (or random, qmc, cmaes)")
    _optuna(f"sampler {name!r}")
    module = SAMPLERS[name][0]
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError:
            raise SamplerError(f"sampler {name!r} needs the {module} package, part of the "
                               f"optuna extra: {INSTALL}, then restart the server") from None
    return name


def parse_pruner(es):
    """An early_stopping table naming one of PRUNERS, checked, with its defaults."""
    rule = es["rule"]
    options, _ = PRUNERS[rule]
    extra = set(es) - set(options) - {"rule"}
    if extra:
        raise SamplerError(f"early_stopping with rule {rule} takes rule, "
                           f"{', '.join(sorted(options))}; unknown: {', '.join(sorted(extra))}")
    out = {"rule": rule}
    for name, (default, low) in options.items():
        v = es.get(name, default)
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < low):
            raise SamplerError(f"early_stopping '{name}' must be a whole number >= {low}"
                               + (' or "auto"' if default == "auto" else "") + f", got {v!r}")
        out[name] = v
    return out


def check_pruner(es, sampler):
    """A pruner of Optuna needs the sweep's study: a sweep with a sampler."""
    if es and es["rule"] in PRUNERS and sampler is None:
        raise SamplerError(f"early_stopping rule {es['rule']} is Optuna's and needs a "
                           "sampler: add sampler = \"tpe\" (or random, qmc, cmaes, grid), "
                           "or use rule = \"median\" or \"asha\"")
    if es and es["rule"] in PRUNERS:
        _optuna(f"early_stopping rule {es['rule']!r}")


def distributions(grid, rand):
    """The sweep's parameters as Optuna distributions: grid lists and choices are
    categorical, the draws float (log for log_uniform) and int."""
    from optuna.distributions import (CategoricalDistribution, FloatDistribution,
                                      IntDistribution)
    out = {name: CategoricalDistribution(values) for name, values in grid.items()}
    for name, p in rand.items():
        kind = p["type"]
        if kind == "choice":
            out[name] = CategoricalDistribution(p["values"])
        elif kind == "int_uniform":
            out[name] = IntDistribution(int(p["low"]), int(p["high"]))
        else:
            out[name] = FloatDistribution(float(p["low"]), float(p["high"]),
                                          log=kind == "log_uniform")
    return out


# -- a trial's result ---------------------------------------------------------------------

def outcome(job_state, stopped, curve, d, key):
    """What to tell the study of a trial whose job ended (stored as the trial's `told`):
    SUCCEEDED -> COMPLETE with the curve's best value (by the direction) and its step;
    stopped early -> PRUNED with its last value; failed, cancelled, or succeeded without
    logging the metric -> FAIL (a sampler learns nothing from it)."""
    if job_state == "SUCCEEDED":
        best = pruning.best_so_far(curve, d=d)
        if best is None:
            return {"state": "FAIL", "why": f"the trial logged no {key}"}
        step = next(s for s, v in curve if v == best)
        return {"state": "COMPLETE", "value": best, "step": step}
    if job_state == "CANCELLED" and stopped:
        if curve:
            return {"state": "PRUNED", "value": curve[-1][1], "step": curve[-1][0]}
        return {"state": "PRUNED"}
    return {"state": "FAIL", "why": job_state}


# -- the studies --------------------------------------------------------------------------

class _Study:
    def __init__(self, optuna, sweep_id, spec, d, replayed=0):
        name = spec["sampler"]
        es = spec.get("early_stopping") or {}
        self.optuna = optuna
        self.grid = name == "grid"
        self.space = distributions(spec["grid"], spec["random"])
        seed = rebuilt_seed(spec["seed"], replayed) if name in RESEEDED else spec["seed"]
        sampler = SAMPLERS[name][1](optuna, seed, spec["grid"])
        pruner = (PRUNERS[es["rule"]][1](optuna, es) if es.get("rule") in PRUNERS
                  else optuna.pruners.NopPruner())
        self.rule = es.get("rule") if es.get("rule") in PRUNERS else None
        self.prunes = self.rule is not None
        # a fixed name: HyperbandPruner puts a trial in its bracket by the study's name
        # and the trial's number, so a rebuilt study keeps the brackets
        self.study = optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                                         study_name=f"gpuplane-sweep-{sweep_id}",
                                         sampler=sampler, pruner=pruner,
                                         direction=DIRECTIONS[d])
        self.running = {}           # our trial number -> optuna Trial
        self.reported = {}          # our trial number -> last step reported

    def ask(self, number, params=None):
        if params is not None and not self.grid:
            self.study.enqueue_trial(params, skip_if_exists=False)
        trial = self.study.ask(self.space)
        if params is not None and not self.grid:
            trial.relative_params     # noqa: B018 -- drawn as at the first ask (docstring)
        if self.grid and params is not None and trial.params != params:
            # the grid sampler is asked plainly in a replay: it is deterministic
            raise SamplerError(f"trial {number}: the grid sampler gave {trial.params} where "
                               f"the trial ran with {params}")
        self.running[number] = trial
        return trial

    def report(self, number, curve):
        """Report the points of the curve past the last reported step; the step of the
        last point."""
        trial = self.running[number]
        last = self.reported.get(number, -1)
        for step, value in curve:
            if step > last and step >= 0:
                trial.report(value, step)
                last = step
        self.reported[number] = last
        return last

    def tell(self, number, told):
        trial = self.running.pop(number)
        last = self.reported.pop(number, -1)
        state = self.optuna.trial.TrialState[told["state"]]
        if state == self.optuna.trial.TrialState.PRUNED and told.get("step", -1) > last:
            trial.report(told["value"], told["step"])    # Optuna's value of a pruned trial
        try:
            if state == self.optuna.trial.TrialState.COMPLETE:
                self.study.tell(trial, told["value"])
            else:
                self.study.tell(trial, state=state)
        except RuntimeError:
            # GridSampler calls study.stop() after the last grid point, which raises
            # outside optimize(); the trial is told all the same (Optuna's docs, GridSampler)
            if not self.grid:
                raise

    def counts(self):
        out = {}
        for t in self.study.get_trials(deepcopy=False):
            out[t.state.name] = out.get(t.state.name, 0) + 1
        return out


class Studies:
    """The studies of the sweeps with a sampler, by sweep id; used by the Sweeper thread
    only. `summary` is read by the API's threads: it is copied under the lock."""

    def __init__(self):
        self._studies = {}
        self._lock = threading.Lock()
        self._summaries = {}
        self._rebuilds = {}

    def loaded(self, sweep_id):
        return sweep_id in self._studies

    def rebuild(self, sweep, d, trials, curves):
        """The sweep's study from its trial rows (in number order, each with `number`,
        `params`, `told`) and, for a pruner, the curves of the ended ones by number."""
        optuna = _optuna(f"sampler {sweep['spec']['sampler']!r}")
        asked = sorted((t for t in trials if t["params"] is not None),
                       key=lambda t: t["number"])
        replayed = len(asked)
        st = _Study(optuna, sweep["id"], sweep["spec"], d, replayed)
        for t in asked:
            st.ask(t["number"], t["params"])
            if t["told"] is not None:
                if st.prunes and curves.get(t["number"]):
                    st.report(t["number"], curves[t["number"]])
                st.tell(t["number"], t["told"])
        self._studies[sweep["id"]] = st
        with self._lock:
            self._rebuilds[sweep["id"]] = self._rebuilds.get(sweep["id"], 0) + 1
        self._publish(sweep["id"], replayed)
        log.info("sweep %d: study rebuilt from %d stored trials (%s)", sweep["id"], replayed,
                 st.counts())
        return st

    def ask(self, sweep_id, number):
        """The parameters of trial `number`, asked of the sampler now."""
        st = self._studies[sweep_id]
        trial = st.ask(number)
        self._publish(sweep_id)
        return {name: trial.params[name] for name in st.space}   # in the sweep's order

    def tell(self, sweep_id, number, told, curve=()):
        st = self._studies[sweep_id]
        if st.prunes and number in st.running and curve:
            st.report(number, curve)
        st.tell(number, told)
        self._publish(sweep_id)

    def prune(self, sweep_id, number, curve, key):
        """Report the running trial's new points and ask its pruner: a decision (as
        gpuplane/pruning.py's rules make them) or None."""
        st = self._studies[sweep_id]
        if number not in st.running or not curve:
            return None
        step = st.report(number, curve)
        if step < 0 or not st.running[number].should_prune():
            return None
        value = curve[-1][1]
        return {"rule": st.rule, "step": step, "value": value, "threshold": None,
                "rung": None,
                "message": f"Optuna's {type(st.study.pruner).__name__} at step {step}: "
                           f"{key} {value:.6g} is not promising (should_prune)"}

    def forget(self, sweep_id):
        """Drop the study from memory (its summary stays): the next use rebuilds it."""
        self._studies.pop(sweep_id, None)
        with self._lock:
            if sweep_id in self._summaries:
                self._summaries[sweep_id]["loaded"] = False

    def keep_only(self, sweep_ids):
        for sweep_id in [i for i in self._studies if i not in sweep_ids]:
            self.forget(sweep_id)

    def _publish(self, sweep_id, replayed=None):
        st = self._studies[sweep_id]
        counts = st.counts()
        with self._lock:
            s = self._summaries.setdefault(sweep_id, {})
            s.update(trials=counts, rebuilds=self._rebuilds.get(sweep_id, 0), loaded=True)
            if replayed is not None:
                s["replayed"] = replayed

    def summary(self, sweep_id):
        """{"trials": {state: n}, "rebuilds", "replayed", "loaded"} of the sweep's study as
        this process last had it (`loaded`: still in memory), or None."""
        with self._lock:
            s = self._summaries.get(sweep_id)
            return None if s is None else {**s, "trials": dict(s["trials"])}
