"""Sweeps: a named set of trials in one experiment (docs/sweeps.md).

A sweep is a command template whose `{param}` placeholders are filled per trial, with
parameters as grid lists and seeded random draws. Every trial is an ordinary job (its
run.config carries the parameters, its name says them). The `Sweeper` thread launches
trials through the lifecycle, never more at once than the sweep's parallel limit, fills
free places as trials end, applies the early-stopping rule (gpuplane/pruning.py) to
running trials from the metric store, stops launching when the first trials all fail, and
marks the sweep DONE when every trial has ended.

The parameter sets are drawn once, at create, and stored: the same seed gives the same
trials, and a re-run keeps its parameters. A sweep with a `sampler` asks Optuna instead,
as each trial is launched, and tells it each result (gpuplane/samplers.py).
"""
import itertools
import logging
import math
import random
import shlex
import string

from . import placeholders, pruning, samplers
from .lifecycle import LimitRefused
from .db import metric_defs, metrics, sweeps as db_sweeps
from .worker import Worker

log = logging.getLogger(__name__)

MAX_TRIALS = 1000         # trials in one sweep (docs/sweeps.md)
MAX_PARALLEL = 256
FAIL_FAST = 3             # this many failed trials and none succeeded: stop launching
DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform", "choice")
RULES = ("median", "asha", *samplers.PRUNERS)
BUILTINS = ("trial", "sweep_id")     # placeholders every template may use
RESERVED = BUILTINS + placeholders.JOB


class SweepError(ValueError):
    """A sweep spec that cannot run; the message names the fix."""


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _scalar(v):
    return isinstance(v, (str, int, float, bool)) and not (isinstance(v, float)
                                                           and not math.isfinite(v))


def parse_parameters(params):
    """{name: list (grid) | {"type": ..., ...} (random)} checked; returns (grid, random)."""
    if not isinstance(params, dict) or not params:
        raise SweepError("'parameters' is required: a table of names to a grid list "
                         "(bs = [16, 32]) or a random draw (lr = {type = \"log_uniform\", "
                         "low = 1e-4, high = 1e-1})")
    grid, rand = {}, {}
    for name, p in params.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
            raise SweepError(f"parameter name {name!r} must be a plain identifier (letters, "
                             f"digits, _) and not one of {', '.join(RESERVED)}")
        if isinstance(p, list):
            if not p:
                raise SweepError(f"parameter {name!r} has an empty grid; give at least one "
                                 f"value ({name} = [0.1, 0.01])")
            if not all(_scalar(v) for v in p) or len(p) > MAX_TRIALS:
                raise SweepError(f"parameter {name!r}: a grid is a list of at most "
                                 f"{MAX_TRIALS} strings, numbers or booleans")
            grid[name] = p
            continue
        if not isinstance(p, dict):
            raise SweepError(f"parameter {name!r} must be a grid list or a table with "
                             f"'type' (one of {', '.join(DISTRIBUTIONS)})")
        kind = p.get("type")
        if kind not in DISTRIBUTIONS:
            raise SweepError(f"parameter {name!r}: 'type' must be one of "
                             f"{', '.join(DISTRIBUTIONS)}, got {kind!r}")
        if kind == "choice":
            values = p.get("values")
            if not isinstance(values, list) or not values or not all(_scalar(v) for v in values):
                raise SweepError(f"parameter {name!r}: a choice needs 'values', a non-empty "
                                 "list of strings or numbers")
            rand[name] = {"type": kind, "values": values}
            continue
        low, high = p.get("low"), p.get("high")
        if not _number(low) or not _number(high):
            raise SweepError(f"parameter {name!r}: a {kind} draw needs numbers 'low' and "
                             "'high'")
        if low > high:
            raise SweepError(f"parameter {name!r}: low ({low}) is above high ({high}); swap "
                             "them")
        if kind == "log_uniform" and low <= 0:
            raise SweepError(f"parameter {name!r}: a log_uniform draw needs low > 0, got "
                             f"{low}; use uniform for ranges that include 0")
        if kind == "int_uniform" and not (float(low).is_integer() and float(high).is_integer()):
            raise SweepError(f"parameter {name!r}: an int_uniform draw needs whole numbers "
                             "for low and high")
        rand[name] = {"type": kind, "low": low, "high": high}
    return grid, rand


def template_names(template):
    """The {names} a command template uses (a string or an argv list)."""
    parts = [template] if isinstance(template, str) else template
    names = set()
    for part in parts:
        try:
            for _, field, spec, conv in string.Formatter().parse(part):
                if field is None:
                    continue
                if not field.isidentifier() or spec or conv:
                    raise SweepError(f"placeholder {{{field}}} in the command: write plain "
                                     "{name} placeholders (and {{ }} for literal braces)")
                names.add(field)
        except ValueError as e:
            raise SweepError(f"the command template does not parse ({e}); write {{name}} "
                             "placeholders and {{ }} for literal braces") from None
    return names


def fill(template, values):
    """The command of one trial: an argv list is filled part by part; a string is a shell
    command, with each value quoted for the shell. {job}, {attempt} and {run} stay for
    the start message (gpuplane/placeholders.py)."""
    later = {k: "{" + k + "}" for k in placeholders.JOB}
    if isinstance(template, str):
        return ["/bin/sh", "-c", template.format(**later, **{
            k: shlex.quote(_text(v)) for k, v in values.items()})]
    return [part.format(**later, **{k: _text(v) for k, v in values.items()})
            for part in template]


def fill_folder(folder, values):
    """A trial's tb_dir / watch_dir: the sweep's names filled, the job's kept."""
    return placeholders.fill(folder, {k: _text(v) for k, v in values.items()})


def _text(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _draw(rng, p):
    kind = p["type"]
    if kind == "choice":
        return p["values"][rng.randrange(len(p["values"]))]
    if kind == "int_uniform":
        return rng.randint(int(p["low"]), int(p["high"]))
    if kind == "uniform":
        x = rng.uniform(p["low"], p["high"])
    else:
        x = math.exp(rng.uniform(math.log(p["low"]), math.log(p["high"])))
    return float(f"{x:.6g}")        # the value in the command is the value in the config


def expand(grid, rand, trials=None, seed=0):
    """The parameter sets, in launch order: every grid combination, each with its own
    random draws; with random parameters, `trials` sets cycling through the grid."""
    names = list(grid)
    combos = 1
    for v in grid.values():
        combos *= len(v)
    if trials is None:
        if rand:
            raise SweepError("random parameters need 'trials', how many to draw "
                             "(trials = 16)")
        trials = combos
    if not grid and not rand:
        raise SweepError("the sweep defines no parameters")
    if trials > MAX_TRIALS or combos > MAX_TRIALS:
        raise SweepError(f"the sweep has {max(trials, combos)} trials; at most {MAX_TRIALS} "
                         "are allowed: narrow the grid or lower 'trials'")
    if trials < 1:
        raise SweepError("'trials' must be at least 1")
    if not rand and trials > combos:
        raise SweepError(f"'trials' is {trials} but the grid has {combos} combinations and "
                         "nothing is drawn at random: drop 'trials' or add a random parameter")
    rng = random.Random(seed)
    product = list(itertools.product(*(grid[n] for n in names))) or [()]
    out = []
    for i in range(trials):
        values = dict(zip(names, product[i % len(product)]))
        for name, p in rand.items():
            values[name] = _draw(rng, p)
        out.append(values)
    return out


def parse_early_stopping(es):
    if es is None or es is False:
        return None
    if not isinstance(es, dict):
        raise SweepError("'early_stopping' must be a table with 'rule' (median or asha)")
    rule = es.get("rule")
    if rule not in RULES:
        raise SweepError(f"early_stopping 'rule' must be one of {', '.join(RULES)}, got "
                         f"{rule!r}")
    if rule in samplers.PRUNERS:
        return samplers.parse_pruner(es)
    known = {"rule", "warmup_steps", "min_trials"} if rule == "median" else \
        {"rule", "min_steps", "eta"}
    extra = set(es) - known
    if extra:
        raise SweepError(f"early_stopping with rule {rule} takes {', '.join(sorted(known))}; "
                         f"unknown: {', '.join(sorted(extra))}")

    def whole(name, default, low):
        v = es.get(name, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise SweepError(f"early_stopping '{name}' must be a whole number >= {low}, got "
                             f"{v!r}")
        return v
    if rule == "median":
        return {"rule": rule, "warmup_steps": whole("warmup_steps", 0, 0),
                "min_trials": whole("min_trials", 3, 1)}
    return {"rule": rule, "min_steps": whole("min_steps", 1, 1), "eta": whole("eta", 3, 2)}


SPEC_KEYS = {"name", "command", "parameters", "trials", "seed", "parallel", "metric",
             "direction", "early_stopping", "working_dir", "gpus", "cpu_only", "priority",
             "max_attempts", "env", "project", "experiment", "tb_dir", "watch_dir", "image",
             "eval_command", "retention", "time_limit", "time_limit_s", "time_limit_min",
             "time_signal", "preemptible", "stop_on", "sampler"}


def parse_spec(data):
    """The sweep's own part of a create body (the job fields are checked by the caller
    as a job's): {name, template, grid, random, trials, seed, parallel, metric,
    direction, early_stopping} and the parameter sets. Raises SweepError."""
    extra = set(data) - SPEC_KEYS
    if extra:
        raise SweepError(f"unknown field(s) {', '.join(sorted(extra))}; a sweep takes "
                         f"{', '.join(sorted(SPEC_KEYS))}")
    template = data.get("command")
    if isinstance(template, str):
        if not template.strip():
            raise SweepError("'command' is empty; give the template, e.g. "
                             "\"python train.py --lr {lr}\"")
    elif not (isinstance(template, list) and template
              and all(isinstance(a, str) for a in template)):
        raise SweepError("'command' is required: a template string such as "
                         "\"python train.py --lr {lr} --bs {bs}\" (or an argv list)")
    grid, rand = parse_parameters(data.get("parameters"))
    used = template_names(template)
    defined = set(grid) | set(rand)
    unknown = used - defined - set(BUILTINS) - set(placeholders.JOB)
    if unknown:
        raise SweepError(f"the command uses {', '.join('{' + n + '}' for n in sorted(unknown))}"
                         " but the sweep defines no such parameter; add it under "
                         "[parameters] or fix the placeholder")
    unused = defined - used
    if unused:
        raise SweepError(f"parameter(s) {', '.join(sorted(unused))} are defined but the "
                         f"command never uses them; add {{{sorted(unused)[0]}}} to the "
                         "command or drop the parameter")
    trials = data.get("trials")
    if trials is not None and (not isinstance(trials, int) or isinstance(trials, bool)):
        raise SweepError(f"'trials' must be a whole number, got {trials!r}")
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SweepError(f"'seed' must be a whole number, got {seed!r}")
    params = expand(grid, rand, trials, seed)
    parallel = data.get("parallel", 1)
    if not isinstance(parallel, int) or isinstance(parallel, bool) or \
            not 1 <= parallel <= MAX_PARALLEL:
        raise SweepError(f"'parallel' must be a whole number from 1 to {MAX_PARALLEL} (how "
                         f"many trials run at once), got {parallel!r}")
    metric = data.get("metric")
    if metric is not None and (not isinstance(metric, str) or not metric.strip()
                               or len(metric) > 200):
        raise SweepError("'metric' must be the name of a logged metric, e.g. \"val_loss\"")
    direction = data.get("direction")
    if direction is not None and direction not in ("min", "max"):
        raise SweepError(f"'direction' must be min or max, got {direction!r}")
    name = data.get("name") or ""
    if not isinstance(name, str) or len(name) > 100:
        raise SweepError("'name' must be a string of at most 100 characters")
    try:
        sampler = samplers.parse_sampler(data.get("sampler"), grid, rand)
        es = parse_early_stopping(data.get("early_stopping"))
        samplers.check_pruner(es, sampler)
    except samplers.SamplerError as e:
        raise SweepError(str(e)) from None
    # with a sampler, `params` are only a sample for the checks: the trials are asked
    return {"name": name.strip(), "template": template, "grid": grid, "random": rand,
            "trials": len(params), "seed": seed, "parallel": parallel, "metric": metric,
            "direction": direction, "sampler": sampler, "early_stopping": es}, params


def resolve_metric(db, spec, project, experiment):
    """(key, direction, where the key came from) of a sweep: its own, else the
    experiment's primary metric; the direction its own, else the metric's definition or
    name. (None, None, None) while neither says."""
    key, origin = spec.get("metric"), "sweep"
    if key is None:
        key, origin = metric_defs.resolve_primary(db, project, experiment)
        if key is None:
            return None, None, None
    d = spec.get("direction")
    if d is None:
        d, _ = metric_defs.resolve_direction(db, key, project, experiment)
    return key, d, origin


def trial_name(sweep_name, number, params):
    said = " ".join(f"{k}={_text(v)}" for k, v in params.items())
    return f"{sweep_name or 'sweep'} #{number} {said}"[:200]


def job_spec(sweep, trial):
    """The job of one trial: the sweep's job fields, the filled command, the parameters
    in config."""
    spec = sweep["spec"]
    base = dict(spec["job"])
    values = {**trial["params"], "trial": trial["number"], "sweep_id": sweep["id"]}
    base.update(
        name=trial_name(sweep["name"], trial["number"], trial["params"]),
        command=fill(spec["template"], values),
        tb_dir=fill_folder(base.get("tb_dir"), values),
        watch_dir=fill_folder(base.get("watch_dir"), values),
        project=sweep["project"], experiment=sweep["experiment"],
        env={**base.get("env", {}), "GPUCTL_SWEEP_ID": str(sweep["id"]),
             "GPUCTL_TRIAL": str(trial["number"])},
        config={**trial["params"], "sweep": {"id": sweep["id"], "trial": trial["number"]}},
        sweep_id=sweep["id"], depends_on=[], depends_any=False, held=False)
    return base


class Sweeper(Worker):
    """Launches, judges and ends sweeps' trials (see the module's docstring). Woken by
    the lifecycle's events of trial jobs; every `interval` it applies early stopping."""
    name = "sweeps"
    interval = 0.5

    def __init__(self, db, lifecycle):
        super().__init__()
        self.db = db
        self.lifecycle = lifecycle
        self._curves = {}        # (run_id, key) -> [last step read, [(step, value)]]
        self.studies = samplers.Studies()     # the Optuna studies of sweeps with a sampler
        self._any_running = True  # until the first pass has looked

    def offer_lifecycle(self, event):
        """lifecycle.on_event listener: a job ended or was re-queued, maybe a trial's
        (with no sweep running, none is: the API wakes this thread when a sweep starts).
        A start changes nothing a pass decides on (a queued trial counts as one running)
        and early stopping looks every `interval`."""
        if self._any_running and event.get("job_id") is not None and event["type"] in (
                "SUCCEEDED", "FAILED", "CANCELLED", "RETRIED"):
            self.wake()

    def tick(self):
        running = db_sweeps.active(self.db)
        self._any_running = bool(running)
        self.studies.keep_only({s["id"] for s in running})    # cancelled, stopped: dropped
        for sweep in running:
            try:
                self.step(sweep)
            except Exception:
                log.exception("sweep %d: a pass failed", sweep["id"])

    def curve(self, run_id, key):
        """The run's points of key (NaN left out), read incrementally."""
        if run_id is None:
            return []
        entry = self._curves.setdefault((run_id, key), [-1, []])
        for step, value in metrics.points_after(self.db, run_id, key, entry[0]):
            entry[0] = step
            if value is not None:
                entry[1].append((step, value))
        return entry[1]

    def step(self, sweep):
        spec = sweep["spec"]
        es = spec.get("early_stopping")
        if es:
            self.early_stop(sweep, db_sweeps.trials(self.db, sweep["id"]), es)
        # the pass after every trial's end: counted in SQL, not read trial by trial (a
        # sweep of short trials read all of them at each)
        n = db_sweeps.tally(self.db, sweep["id"])
        if spec.get("sampler"):
            # after the count: every trial that ended before it is told before the next
            # ask (one that ends after it is still counted active, and makes no room)
            self.tell(sweep)
        if n["failed"] >= FAIL_FAST and not n["succeeded"]:
            failed = [t for t in db_sweeps.trials(self.db, sweep["id"])
                      if t["job_state"] == "FAILED" and not t["retry"]]
            said = "; ".join(f"job {t['job_id']}: {t['failure_kind'] or 'FAILED'}"
                             + (f" (exit {t['exit_code']})" if t["exit_code"] not in (None, 0)
                                else "") for t in failed[:FAIL_FAST])
            reason = (f"the first {len(failed)} trials failed and none succeeded ({said}); "
                      f"read `gpuplane logs {failed[0]['job_id']}`, fix the command, then "
                      f"`gpuplane sweep retry-failed {sweep['id']}`")
            with self.lifecycle.transaction() as t:
                db_sweeps.set_state(t.conn, sweep["id"], "STOPPED", reason)
                t.publish = True
            log.warning("sweep %d stopped: %s", sweep["id"], reason)
            return
        room = spec["parallel"] - n["active"]
        for trial in db_sweeps.next_trials(self.db, sweep["id"], room) if room > 0 else ():
            try:
                self.launch(sweep, trial)
            except LimitRefused as e:       # the project's maximum changed since create
                with self.lifecycle.transaction() as t:
                    db_sweeps.set_state(t.conn, sweep["id"], "STOPPED", str(e))
                    t.publish = True
                log.warning("sweep %d stopped: %s", sweep["id"], e)
                return
        if not n["todo"] and not n["active"]:
            with self.lifecycle.transaction() as t:
                db_sweeps.set_state(t.conn, sweep["id"], "DONE")
                t.publish = True
            self.studies.forget(sweep["id"])
            if self._curves:
                ended = {t["run_id"] for t in db_sweeps.trials(self.db, sweep["id"])}
                for k in [k for k in self._curves if k[0] in ended]:
                    del self._curves[k]     # a finished sweep's curves are not read again

    def launch(self, sweep, trial):
        sampler = sweep["spec"].get("sampler")
        try:
            asked = trial["params"] is None
            if asked:                       # a sampler's trial: its parameters asked now
                self.study(sweep)
                trial = dict(trial, params=self.studies.ask(sweep["id"], trial["number"]))
            with self.lifecycle.transaction() as t:
                if trial["retry"] and trial["job_id"] is not None:
                    job, accepted = self.lifecycle.retry(trial["job_id"], t=t, resume=True)
                    if accepted:
                        db_sweeps.set_trial_retry(t.conn, trial["id"], False)
                        db_sweeps.set_trial_rung(t.conn, trial["id"], 0)
                        if sampler:         # told FAIL before: replayed as running
                            self.studies.forget(sweep["id"])
                        return
                job = self.lifecycle.submit(job_spec(sweep, trial), t=t)
                db_sweeps.set_trial_job(t.conn, trial["id"], job["id"])
                if asked:
                    db_sweeps.set_trial_params(t.conn, trial["id"], trial["params"])
                db_sweeps.set_trial_rung(t.conn, trial["id"], 0)
        except Exception:
            # the study may hold an ask the database does not: rebuild it from the database
            self.studies.forget(sweep["id"])
            raise

    def study(self, sweep):
        """Load the sweep's study (rebuilt from its stored trials) if it is not in memory."""
        if self.studies.loaded(sweep["id"]):
            return
        key, d, _ = resolve_metric(self.db, sweep["spec"], sweep["project"],
                                   sweep["experiment"])
        trials = db_sweeps.trials(self.db, sweep["id"])
        curves = {}
        if (sweep["spec"].get("early_stopping") or {}).get("rule") in samplers.PRUNERS:
            curves = {t["number"]: self.curve(t["run_id"], key) for t in trials
                      if t["told"] is not None}
        self.studies.rebuild(sweep, d, trials, curves)

    def tell(self, sweep):
        """Tell the study the results of the trials whose jobs ended since the last pass."""
        ended = db_sweeps.untold(self.db, sweep["id"])
        if not ended:
            return
        key, d, _ = resolve_metric(self.db, sweep["spec"], sweep["project"],
                                   sweep["experiment"])
        try:
            self.study(sweep)
            for trial in ended:
                curve = self.curve(trial["run_id"], key)
                stopped = trial["stopped"] or (trial["job_stop_reason"] or {}).get(
                    "reason") == "EARLY_STOPPED"
                told = samplers.outcome(trial["job_state"], stopped, curve, d, key)
                self.studies.tell(sweep["id"], trial["number"], told, curve)
                with self.lifecycle.transaction() as t:
                    db_sweeps.set_trial_told(t.conn, trial["id"], told)
        except Exception:
            self.studies.forget(sweep["id"])
            raise

    def early_stop(self, sweep, trials, es):
        key, d, _ = resolve_metric(self.db, sweep["spec"], sweep["project"],
                                   sweep["experiment"])
        if key is None or d not in ("min", "max"):
            return
        curves = {t["id"]: self.curve(t["run_id"], key) for t in trials if t["run_id"]}
        for trial in trials:
            if trial["job_state"] != "RUNNING" or trial["stopped"] or not curves.get(trial["id"]):
                continue
            mine = curves[trial["id"]]
            others = [c for tid, c in curves.items() if tid != trial["id"]]
            if es["rule"] in samplers.PRUNERS:
                self.study(sweep)
                passed, decision = trial["rung"], self.studies.prune(
                    sweep["id"], trial["number"], mine, key)
            elif es["rule"] == "median":
                passed, decision = trial["rung"], pruning.median_rule(
                    mine, others, d, warmup_steps=es["warmup_steps"],
                    min_trials=es["min_trials"], key=key)
            else:
                passed, decision = pruning.asha(mine, others, d, trial["rung"],
                                                min_steps=es["min_steps"], eta=es["eta"],
                                                key=key)
            if decision is not None and pruning.is_best_trial(mine, others, d):
                decision = None       # never the current best trial
            if passed != trial["rung"] or decision is not None:
                self.apply(trial, passed, decision, key)

    def apply(self, trial, passed, decision, key):
        with self.lifecycle.transaction() as t:
            db_sweeps.set_trial_rung(t.conn, trial["id"], passed)
            if decision is None:
                return
            decision = {"reason": "EARLY_STOPPED", "key": key, **decision}
            db_sweeps.set_trial_stopped(t.conn, trial["id"], decision)
            self.lifecycle.cancel(trial["job_id"], t=t, stop_reason=decision)
        log.info("sweep trial job %d early stopped: %s", trial["job_id"], decision["message"])
